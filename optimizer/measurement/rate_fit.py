"""Pure: a trial's rate at the limit and its 95% interval, from every request it sent at every rate.

Each probe of a trial (optimizer/measurement/evidence.py) leaves a count: k of its n requests over the TTFT limit
at its rate r. The share over rises with the rate; the rate at the limit is where it crosses 1% (TTFT P99 = the
limit). All probes are pooled in one fit of that share against the rate, a logistic curve in log rate,

    logit P(over | r) = logit(1%) + b * log(r / r*) / SCALE,   0 < b <= 20 (the share only rises with load),

so that r*, the rate at the limit, is a parameter of its own. Its 95% interval is the profile-likelihood interval:
every r* whose best slope leaves the log likelihood within chi2(1, 0.95) / 2 of the maximum. Where probes near the
crossing have counts on both sides, the interval is narrow; where only a probe with none over and a probe with all
over bracket it (no overlap to fit a slope on), every root between them is as likely and the interval spans the gap,
as it should. Requests of one probe are not independent draws (a burst of arrivals delays the requests behind it
together), so each probe counts as n x its independent fraction: clusters of overs / overs, the runs estimator of
the extremal index (`evidence.Counted`).

That interval counts the requests as a sample of the probes' own; it knows nothing of the draw they came from.
Every probe of a trial replays the same requests in the same order (common random numbers: configs are compared on
the same draw), so a burst of long prompts early in the draw pushes every probe the same way. The block bootstrap
over the draw measures that: blocks of BLOCK_REQUESTS consecutive requests, drawn with replacement, the same blocks
for every probe (each probe stores which requests were over), the counts recomputed, the root found again. The
interval is the union of the two.

Nor does either know the machine: on a shared machine one engine runs each replay a little faster or slower than
the last (a replay-to-replay speed CV of about 5%: docs/simulator.md, "Noise and drift"), and a slower replay is,
to the engine, a higher rate. So the likelihood is that of a model with a random effect per probe: each probe's
count is binomial at the rate its engine felt, its rate x exp(N(0, REPLAY_SPEED_CV)), integrated over that factor
(on SPEED_NODES). Probes whose counts do not rise with the rate (a slow replay at a lower rate, a fast one at a
higher) are then explained by their speed, not by a flat curve with a sharply placed root, and the interval
widens as m probes at the crossing share the speed noise (by about 1/sqrt(m)). The bootstrap, which covers the
draw, resamples with the speed fixed. What the interval does not cover is a fresh engine's own speed (a whole
trial varies 12-18% from one engine start to the next on a shared 2-core machine): that is the confirmation's to
measure, in rounds on fresh engines (optimizer/search/confirm.py). With the engines on tcmalloc that variation is
smaller, and read back from a real study (benchmarks/speed_cv.py; docs/measurement.md, "The README's run again on
tcmalloc") the probes of one run prefer no speed term at all, while the 5% is what makes a run's interval cover the
same config's rate in the other rounds (in 85% of 152 over two studies): in effect the term now stands for what
moves a run from one engine start and quarter-hour to the next, more than for one replay against the next.

The speed widens the interval; it does not place the rate. The rate at the limit is the counts' own most likely root
(the profile without the speed). Integrated over each replay's speed, a probe with none of 1000 requests over is
evidence that holds whether its replay ran fast or slow, while a probe with a sixth to a third of its requests over
is explained as a slow replay; the most likely root then moved up, past the lowest rate at which those requests were
over, and its interval with it. Over the 175 trials and confirmation runs of seven real studies (2026-12-04/05, the
Xeon; benchmarks/fit_point.py) that root lay above a probe with more than 5% of its requests over in 49 of 158, and
above the counts' own root by a median of 1.0%, up to 14%: a rate the engine had already missed. So the interval is
both profile intervals together (the counts' own, which holds the point, and the one with the speed), widened to
the bootstrap's range; the bootstrap finds the counts' own root in each resample, so the point sits where its
spread is centred.

Only the probes up to the first one with most of its requests over enter the fit: far past the knee the engine is in
another regime (a queue that grows), and one such probe is enough to bound the rate from above.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from optimizer.measurement.evidence import EXCESS_SHARE

SCALE = 0.05  # one unit of the fit's x is 5% of rate: slopes of ~1-10 per unit, where the ridge is weak
SLOPES_PER_UNIT = np.geomspace(0.05, 20.0, 24)  # how steeply the logit of the share over may rise per 5% of rate
GRID_STEP = 0.04  # units of SCALE: candidate rates 0.2% apart
GRID_MARGIN = 3.0  # candidate rates reach 15% past the lowest and highest probes
CHI2_1_95 = 3.841  # the 95% quantile of chi-square with 1 degree of freedom
BLOCK_REQUESTS = 50  # the block bootstrap's blocks: consecutive requests, longer than a burst's reach
RESAMPLES = 100
REPLAY_SPEED_CV = 0.05  # log-normal sigma of one engine's speed from one replay to the next on a shared machine
SPEED_NODES = np.linspace(-3.0, 3.0, 17)  # a probe's speed, in standard deviations: the integral's nodes
SPEED_WEIGHTS = np.exp(-SPEED_NODES ** 2 / 2) / np.exp(-SPEED_NODES ** 2 / 2).sum()
# stored with each fit (fits before 2026-12-05 placed the rate with the speed: a median 1.0% higher)
FIT_METHOD = ("pooled logistic fit of the share over the limit: the rate, the counts' most likely root; 95% interval: "
              "profile likelihood with and without each probe's replay speed a random effect (5%), widened to a "
              "block bootstrap over the workload's requests")


@dataclass(frozen=True)
class ProbeCount:
    """One probe as the fit reads it."""

    rate_rps: float
    requests: int
    over_limit: int
    effective_fraction: float = 1.0
    over_indices: tuple[int, ...] | None = None  # which requests (workload indices) were over; None: not stored


@dataclass(frozen=True)
class RateAtLimit:
    """The rate at which TTFT P99 meets the limit, with its 95% interval (high is inf when no probe went past
    the limit: a lower bound)."""

    rate_rps: float
    low_rps: float
    high_rps: float
    requests: int  # every request the fit pooled
    probes: int

    @property
    def half_width(self) -> float:
        """Half the interval's width, as a share of the rate (inf for a lower bound)."""
        if not math.isfinite(self.high_rps) or self.rate_rps <= 0:
            return math.inf
        return (self.high_rps - self.low_rps) / 2 / self.rate_rps

    def contains(self, rate_rps: float) -> bool:
        return self.low_rps <= rate_rps <= self.high_rps

    def to_dict(self) -> dict[str, float | int | str | None]:
        return {"rate_rps": self.rate_rps, "low_rps": self.low_rps,
                "high_rps": self.high_rps if math.isfinite(self.high_rps) else None,
                "requests": self.requests, "probes": self.probes, "method": FIT_METHOD}

    @classmethod
    def from_dict(cls, d: dict) -> RateAtLimit:
        high = d.get("high_rps")
        return cls(float(d["rate_rps"]), float(d["low_rps"]), math.inf if high is None else float(high),
                   int(d.get("requests", 0)), int(d.get("probes", 0)))


def used_in_fit(probes: Sequence[ProbeCount]) -> list[ProbeCount]:
    """The probes up to (and with) the lowest-rate one that had most of its requests over."""
    ordered = sorted((p for p in probes if p.requests > 0), key=lambda p: p.rate_rps)
    out = []
    for p in ordered:
        out.append(p)
        if p.over_limit > p.requests / 2:
            break
    return out


def profile(probes: Sequence[ProbeCount], share: float = EXCESS_SHARE,
            speed_cv: float = REPLAY_SPEED_CV) -> tuple[np.ndarray, np.ndarray]:
    """(rates, log likelihood): for each candidate rate at the limit on a grid, the log likelihood of the probes'
    counts under the best slope in SLOPES_PER_UNIT. Each probe's count is binomial at its rate as the engine felt
    it, rate x exp(N(0, speed_cv)) (its replay's own speed), integrated over that factor on SPEED_NODES."""
    rates = np.array([p.rate_rps for p in probes])
    ref = float(np.exp(np.mean(np.log(rates))))
    x = np.log(rates / ref) / SCALE
    n = np.array([max(p.requests * p.effective_fraction, 1.0) for p in probes])
    k = n * np.array([p.over_limit / p.requests for p in probes])
    roots = np.arange(x.min() - GRID_MARGIN, x.max() + GRID_MARGIN, GRID_STEP)
    shifts = SPEED_NODES * speed_cv / SCALE if speed_cv > 0 else np.zeros(1)
    log_w = np.log(SPEED_WEIGHTS) if speed_cv > 0 else np.zeros(1)
    ll = np.full(len(roots), -np.inf)
    for b in SLOPES_PER_UNIT:  # one slope at a time: roots x probes x speed nodes
        z = math.log(share / (1 - share)) + b * (x[None, :, None] + shifts[None, None, :] - roots[:, None, None])
        log_p, log_q = -np.logaddexp(0.0, -z), -np.logaddexp(0.0, z)  # log p, log (1 - p), stable
        per_probe = np.logaddexp.reduce(log_w + k[None, :, None] * log_p + (n - k)[None, :, None] * log_q, axis=2)
        ll = np.maximum(ll, per_probe.sum(axis=1))
    return ref * np.exp(SCALE * roots), ll


def most_likely_rps(probes: Sequence[ProbeCount], share: float = EXCESS_SHARE,
                    speed_cv: float = REPLAY_SPEED_CV) -> float:
    rates, ll = profile(probes, share, speed_cv)
    return float(rates[int(np.argmax(ll))])


def resampled(probes: Sequence[ProbeCount], rng: np.random.Generator) -> list[ProbeCount]:
    """The probes' counts on one block-bootstrap draw of the workload's requests: blocks of BLOCK_REQUESTS
    consecutive requests drawn with replacement, the same blocks for every probe (each replayed the same requests,
    in the same order, at its own rate)."""
    longest = max(p.requests for p in probes)
    blocks = rng.integers(0, math.ceil(longest / BLOCK_REQUESTS), size=math.ceil(longest / BLOCK_REQUESTS))
    starts = blocks * BLOCK_REQUESTS
    out = []
    for p in probes:
        over = np.asarray(p.over_indices or (), dtype=int)
        n = int(np.clip(p.requests - starts, 0, BLOCK_REQUESTS).sum())
        k = int(sum(((over >= s) & (over < s + BLOCK_REQUESTS)).sum() for s in starts)) if len(over) else 0
        out.append(ProbeCount(p.rate_rps, max(n, 1), min(k, max(n, 1)), p.effective_fraction))
    return out


def fit_rate_at_limit(probes: Sequence[ProbeCount], share: float = EXCESS_SHARE, resamples: int = RESAMPLES,
                      seed: int = 0, speed_cv: float = REPLAY_SPEED_CV) -> RateAtLimit | None:
    """The rate at the limit (the counts' most likely root, without the replays' speed: see above) and its 95%
    interval: the profile-likelihood intervals with and without each probe integrated over its replay's own speed
    (`profile`) together, widened to the block bootstrap's 2.5%-97.5% range when every probe stored which requests
    were over. None when no probe passed (no rate bounds it from below)."""
    used = used_in_fit(probes)
    if not used or all(p.over_limit / p.requests > share for p in used):
        return None
    total = sum(p.requests for p in used)
    if not any(p.over_limit / p.requests > share for p in used):  # nothing past the limit: a lower bound
        top = max(p.rate_rps for p in used)
        return RateAtLimit(top, top, math.inf, total, len(used))
    rates, ll = profile(used, share, speed_cv)
    inside = rates[ll >= ll.max() - CHI2_1_95 / 2]
    best = float(rates[int(np.argmax(ll))])
    low, high = float(inside.min()), float(inside.max())
    if speed_cv > 0:  # the rate and the interval without the speed; the speed's interval widens that one
        rates, ll = profile(used, share, 0.0)
        counted = rates[ll >= ll.max() - CHI2_1_95 / 2]
        best = float(rates[int(np.argmax(ll))])
        low, high = min(low, float(counted.min())), max(high, float(counted.max()))
    if resamples and all(p.over_indices is not None for p in used):
        rng = np.random.default_rng(seed)
        boot = [most_likely_rps(resampled(used, rng), share, 0.0) for _ in range(resamples)]
        b_low, b_high = (float(v) for v in np.quantile(boot, [0.025, 0.975]))
        low, high = min(low, b_low), max(high, b_high)
    return RateAtLimit(best, low, high, total, len(used))
