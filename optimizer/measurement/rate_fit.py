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

Nor does either know the machine. A trial's interval is read as where the same config's rate would fall if it were
measured again on this machine: another engine start, another draw, minutes later. What moves that is the run as a
whole, not each probe on its own (benchmarks/speed_cv.py; docs/measurement.md, "A run's interval: the machine moves
the run, not each probe"), so each end of the interval is widened, in log rate, by a term for the run: the counts'
own distance to it and 1.96 x REMEASURE_CV added in quadrature. At 4% a run's interval covers the same config's rate
in another round in 91% of 152 pairs of two real studies (median half-width +-8.8%); a per-probe speed term covers
85% at +-9.0%, and stays in `profile` (`speed_cv`) for the simulator's model and the benchmark that weighs it.

The run's term widens the interval; it does not place the rate. The rate at the limit is the counts' own most likely
root: integrated over each replay's speed, the likelihood explains a probe well over the limit as a slow replay and
can put the root above a rate the engine already missed (benchmarks/fit_point.py). The bootstrap finds the counts'
own root in each resample, so the point sits where its spread is centred.

Only the probes up to the first one with more than PAST_KNEE_SHARE (5%) of its requests over enter the fit: one such
probe, five times the limit's share, bounds the rate from above, and past it the engine is in another regime (a queue
that grows, or a plateau of stalls) whose shape the logistic curve does not have. Probes on a plateau flatten the
fitted slope and carry the root below the probes that passed (docs/measurement.md, "The fit ends a bisection only
inside 6%, and reads no plateau").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from optimizer.measurement.evidence import EXCESS_SHARE

SCALE = 0.05  # one unit of the fit's x is 5% of rate: slopes of ~1-10 per unit, where the ridge is weak
SLOPES_PER_UNIT = np.geomspace(0.05, 20.0, 24)  # how steeply the logit of the share over may rise per 5% of rate
# the interval's profile maximises over 4x finer slopes: on a steep knee (slope 2 per unit) the coarse grid's ridge is
# jagged and its 95% interval covered a known curve's rate in 88% of 300 draws, the fine one in 93% (1.7 -> 11 ms a
# profile; the bootstrap's argmaxes keep the coarse grid)
FINE_SLOPES_PER_UNIT = np.geomspace(0.05, 20.0, 96)
GRID_STEP = 0.04  # units of SCALE: candidate rates 0.2% apart
GRID_MARGIN = 3.0  # candidate rates reach 15% past the lowest and highest probes
CHI2_1_95 = 3.841  # the 95% quantile of chi-square with 1 degree of freedom
BLOCK_REQUESTS = 50  # the block bootstrap's blocks: consecutive requests, longer than a burst's reach
RESAMPLES = 100
PAST_KNEE_SHARE = 0.05  # the first probe with more than this share of its requests over is the last the fit reads
REMEASURE_CV = 0.04  # log-normal sigma of a run's rate measured again on this machine (fresh engine, draw, minutes)
Z_95 = 1.96  # two-sided 95% of the normal
SPEED_NODES = np.linspace(-3.0, 3.0, 17)  # a probe's speed, in standard deviations: the integral's nodes
SPEED_WEIGHTS = np.exp(-SPEED_NODES ** 2 / 2) / np.exp(-SPEED_NODES ** 2 / 2).sum()
# stored with each fit, so that a stored fit says how its rate and interval were found
FIT_METHOD = ("pooled logistic fit of the share over the limit: the rate, the counts' most likely root; 95% interval: "
              "profile likelihood widened to a block bootstrap over the workload's requests, each end then widened "
              f"by a re-measurement's {REMEASURE_CV:.0%} (log-normal) in quadrature")


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
    """The probes up to (and with) the lowest-rate one that had more than PAST_KNEE_SHARE of its requests over."""
    ordered = sorted((p for p in probes if p.requests > 0), key=lambda p: p.rate_rps)
    out = []
    for p in ordered:
        out.append(p)
        if p.over_limit > PAST_KNEE_SHARE * p.requests:
            break
    return out


def profile(probes: Sequence[ProbeCount], share: float = EXCESS_SHARE, speed_cv: float = 0.0,
            slopes: np.ndarray = SLOPES_PER_UNIT) -> tuple[np.ndarray, np.ndarray]:
    """(rates, log likelihood): for each candidate rate at the limit on a grid, the log likelihood of the probes'
    counts under the best slope in `slopes` (per SCALE unit). Each probe's count is binomial at its rate as the
    engine felt it, rate x exp(N(0, speed_cv)) (its replay's own speed), integrated over that factor on
    SPEED_NODES."""
    rates = np.array([p.rate_rps for p in probes])
    ref = float(np.exp(np.mean(np.log(rates))))
    x = np.log(rates / ref) / SCALE
    n = np.array([max(p.requests * p.effective_fraction, 1.0) for p in probes])
    k = n * np.array([p.over_limit / p.requests for p in probes])
    roots = np.arange(x.min() - GRID_MARGIN, x.max() + GRID_MARGIN, GRID_STEP)
    shifts = SPEED_NODES * speed_cv / SCALE if speed_cv > 0 else np.zeros(1)
    log_w = np.log(SPEED_WEIGHTS) if speed_cv > 0 else np.zeros(1)
    ll = np.full(len(roots), -np.inf)
    for b in slopes:  # one slope at a time: roots x probes x speed nodes
        z = math.log(share / (1 - share)) + b * (x[None, :, None] + shifts[None, None, :] - roots[:, None, None])
        log_p, log_q = -np.logaddexp(0.0, -z), -np.logaddexp(0.0, z)  # log p, log (1 - p), stable
        per_probe = np.logaddexp.reduce(log_w + k[None, :, None] * log_p + (n - k)[None, :, None] * log_q, axis=2)
        ll = np.maximum(ll, per_probe.sum(axis=1))
    return ref * np.exp(SCALE * roots), ll


def most_likely_rps(probes: Sequence[ProbeCount], share: float = EXCESS_SHARE,
                    speed_cv: float = 0.0) -> float:
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


def widened(rate_rps: float, low_rps: float, high_rps: float,
            remeasure_cv: float = REMEASURE_CV) -> tuple[float, float]:
    """(low, high) with each end's distance from the rate, in log rate, and Z_95 x `remeasure_cv` added in
    quadrature: the counts' interval made one for the rate measured again (an infinite high stays infinite)."""
    if remeasure_cv <= 0:
        return low_rps, high_rps
    run = Z_95 * remeasure_cv
    low = rate_rps * math.exp(-math.hypot(math.log(rate_rps / low_rps), run))
    high = rate_rps * math.exp(math.hypot(math.log(high_rps / rate_rps), run)) if math.isfinite(high_rps) else math.inf
    return low, high


def fit_rate_at_limit(probes: Sequence[ProbeCount], share: float = EXCESS_SHARE, resamples: int = RESAMPLES,
                      seed: int = 0, speed_cv: float = 0.0,
                      remeasure_cv: float = REMEASURE_CV) -> RateAtLimit | None:
    """The rate at the limit (the counts' most likely root) and its 95% interval: the profile-likelihood interval,
    widened to the block bootstrap's 2.5%-97.5% range when every probe stored which requests were over, then each end
    by a re-measurement's `remeasure_cv` (`widened`; 0: the counts' own precision, as the search reads it while it
    bisects). `speed_cv` > 0 also takes in the profile interval with each probe integrated over its replay's own
    speed (the simulator's model; see above). None when no probe passed (no rate bounds it from below)."""
    used = used_in_fit(probes)
    if not used or all(p.over_limit / p.requests > share for p in used):
        return None
    total = sum(p.requests for p in used)
    if not any(p.over_limit / p.requests > share for p in used):  # nothing past the limit: a lower bound
        top = max(p.rate_rps for p in used)
        return RateAtLimit(top, widened(top, top, math.inf, remeasure_cv)[0], math.inf, total, len(used))
    rates, ll = profile(used, share, 0.0, FINE_SLOPES_PER_UNIT)
    inside = rates[ll >= ll.max() - CHI2_1_95 / 2]
    best = float(rates[int(np.argmax(ll))])
    low, high = float(inside.min()), float(inside.max())
    if speed_cv > 0:  # the interval with each probe's own speed widens the counts' one; it does not move the rate
        rates, ll = profile(used, share, speed_cv, FINE_SLOPES_PER_UNIT)
        moving = rates[ll >= ll.max() - CHI2_1_95 / 2]
        low, high = min(low, float(moving.min())), max(high, float(moving.max()))
    if resamples and all(p.over_indices is not None for p in used):
        rng = np.random.default_rng(seed)
        boot = [most_likely_rps(resampled(used, rng), share, 0.0) for _ in range(resamples)]
        b_low, b_high = (float(v) for v in np.quantile(boot, [0.025, 0.975]))
        low, high = min(low, b_low), max(high, b_high)
    low, high = widened(best, low, high, remeasure_cv)
    return RateAtLimit(best, low, high, total, len(used))
