"""What does the bisection's stop rule do to a run's rate at the limit? Reads finished real studies (starts nothing)
and replays, on every stored search trial and confirmation run, the stop rule of a bisection
(`measurement/rate_search.py::bisected_enough`) over its probes in the order they ran, two ways:

- **the fit alone** (`fit_bracket` inf): passed and failed
  within 3%, or the pooled fit's counts' own interval within +-3%, however far apart passed and failed still are;
- **the product's rule** (FIT_BRACKET): the fit's interval ends it only once passed and failed are within 6% (a
  search trial's rule; a confirmation run bisects to 3% whatever its fit says, RUN_FIT_BRACKET, and replays here as
  if it were a search trial).

A run made under the product's rule holds the probes the fit alone would have stopped at, as its first ones: its rate
under the fit alone is the fit of that prefix, and both rates come from one run (one engine, one draw, one minute of
the machine). Per study and both ways: how many runs the fit alone stops earlier and what that saves (probes,
requests, seconds of sending at their rates), the confirmation's residual spread of a run (log rate, config and
round removed: fit_point.py::residual_sd) and the gain interval of the recommendation over vLLM's defaults from the
rates (measurement/intervals.py::block_gain_interval at 95%). A run made under the fit alone that stopped on it is
counted as such (what the product's rule would have added is not in the study). Over all the studies given, the runs
split by how far apart their rate passed and rate failed were when they stopped (within FIT_BRACKET or wider): how
far each run's stored rate lies from its config's median over its rounds (root mean square, log rate).

    .venv/bin/python benchmarks/stop_rule.py studies/default [DIR/NAME ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna  # noqa: E402
from fit_point import curve_points, residual_sd, stored_study  # noqa: E402

from optimizer.config.settings import RateSearchSpec  # noqa: E402
from optimizer.measurement.intervals import block_gain_interval  # noqa: E402
from optimizer.measurement.rate_fit import fit_rate_at_limit  # noqa: E402
from optimizer.measurement.rate_search import FIT_BRACKET, CurvePoint, bisected_enough, probe_counts  # noqa: E402
from optimizer.search.attrs import CONFIRM  # noqa: E402
from optimizer.search.measured import measurement_of  # noqa: E402
from optimizer.search.confirmed import confirmation  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Replayed:
    """One stored run, its stop rule replayed: where each rule stops (the count of probes) and the rate it gives."""

    probes: int  # probes the run made (sized by evidence: repeats and fixed-length replays are not probes)
    old_stop: int  # probes the fit alone would have made (the run's own count when it never stops earlier)
    old_rps: float | None
    new_rps: float | None  # None: the rule now would have gone on past the run's last probe
    saved_requests: int
    saved_s: float


def probes_of(trial) -> list[CurvePoint]:
    """The trial's probes sized by evidence, in the order they ran (a stored curve ends with any repeats at the best
    rate, replays of a fixed length: no probe of the bisection)."""
    return [p for p in curve_points(trial) if p.requests is not None and math.isfinite(p.offered_rate_rps)]


def stop_at(points: list[CurvePoint], fit_bracket: float) -> int | None:
    """How many of `points` a bisection under `fit_bracket` runs before it stops, as `search_rate` checks it: after
    each probe once a rate passed and a rate failed (None: not within them)."""
    lo = hi = None
    for i, p in enumerate(points):
        if p.feasible:
            lo = p.offered_rate_rps if lo is None else max(lo, p.offered_rate_rps)
        else:
            hi = p.offered_rate_rps if hi is None else min(hi, p.offered_rate_rps)
        if lo is not None and hi is not None and bisected_enough(points[:i + 1], lo, hi, fit_bracket=fit_bracket):
            return i + 1
    return None


def rate(points: list[CurvePoint]) -> float | None:
    fit = fit_rate_at_limit(probe_counts(points), resamples=0)
    return fit.rate_rps if fit is not None and math.isfinite(fit.high_rps) else None


def replayed(trial, max_replays: int = RateSearchSpec().max_replays) -> Replayed | None:
    """Both rules on `trial`'s probes. A run that ended before either rule fired (no rate failed, the incumbent's
    floor, a flat descent) or at its cap of probes ends there under both; a run that stopped on the fit alone with
    passed and failed wider than FIT_BRACKET has no rate under the rule now (it would have gone on)."""
    points = probes_of(trial)
    if not points:
        return None
    old = stop_at(points, math.inf)
    new = stop_at(points, FIT_BRACKET)
    if old is None or (new is None and len(points) >= max_replays):
        old, new = old or len(points), new or len(points)
    left = points[old:]
    return Replayed(len(points), old, rate(points[:old]), rate(points[:new]) if new else None,
                    sum(p.requests or 0 for p in left), sum((p.requests or 0) / p.offered_rate_rps for p in left))


def compared(c, replays: dict[tuple[int, int], Replayed]) -> tuple[str, str, str, str]:
    """The residual spread and the gain of the leader (vLLM's defaults leading: the best other) over vLLM's defaults,
    the fit alone's and the rule now's, on
    the same rounds and configs: the full rounds in which the leader and the defaults have a rate both ways, and the
    configs that have one in each of them."""
    both = {(n, r): (rp.old_rps, rp.new_rps) for (n, r), rp in replays.items() if rp.old_rps and rp.new_rps}
    base = c.base
    others = [x for x in c.configs if x is not base]
    if base is None or not others:
        return "-", "-", "-", "-"
    best = c.best if c.best is not base else max(others, key=lambda x: c.interval(x).median)  # the defaults led
    rounds = [r for r in c.full_rounds if (best.number, r) in both and (base.number, r) in both]
    numbers = [base.number, best.number] + [x.number for x in c.configs if x not in (base, best)
                                            and all((x.number, r) in both for r in rounds)]
    if len(rounds) < 2:
        return "-", "-", "-", "-"
    out = []
    for way in (0, 1):
        rows = [[both[n, r][way] for r in rounds] for n in numbers]
        g = block_gain_interval(rows, 0, 1)
        out += [f"{residual_sd(rows):.3f} ({len(rows)} x {len(rounds)})",
                f"#{best.number} {g.median:+.1%} [{g.low:+.1%}, {g.high:+.1%}] (+-{(g.high - g.low) / 2:.1%})"]
    return out[0], out[2], out[1], out[3]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("studies", nargs="+", help="DIR/NAME of a real study (its DIR/NAME.db)")
    args = p.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    print("| study | runs and trials | the fit alone stops earlier | saved: probes, requests, s of sending | "
          "confirmation runs | residual spread, the fit alone / now | gain, the fit alone | gain, now |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")
    by_width: dict[bool, list[float]] = {False: [], True: []}
    for path in args.studies:
        study = stored_study(Path(path))
        c = confirmation(study)
        runs = [] if c is None else [(x, r, t) for x in c.configs for r, t in x.runs.items()
                                     if not CONFIRM.of(t).get("served")]
        replays = {(x.number, r): rp for x, r, t in runs if (rp := replayed(t)) is not None}
        done = [*replays.values(), *(rp for t in study.trials if (rp := replayed(t)) is not None)]
        earlier = [rp for rp in done if rp.old_stop < rp.probes]
        old_spread, new_spread, old_gain, new_gain = ("-",) * 4 if c is None else compared(c, replays)
        print(f"| {path} | {len(done)} | {len(earlier)} | {sum(rp.probes - rp.old_stop for rp in earlier)}, "
              f"{sum(rp.saved_requests for rp in earlier)}, {sum(rp.saved_s for rp in earlier):.0f} | {len(runs)} | "
              f"{old_spread} / {new_spread} | {old_gain} | {new_gain} |")
        for x in [] if c is None else c.configs:
            measured = [m for _, t in sorted(x.runs.items())
                        if not CONFIRM.of(t).get("served") and (m := measurement_of(t)) is not None]
            stored = [(m.rate_at_limit.rate_rps, m.failed_rate_rps / m.rate_rps - 1) for m in measured
                      if m.rate_at_limit is not None and m.rate_rps and m.failed_rate_rps]
            if stored:
                mid = statistics.median(math.log(v) for v, _ in stored)
                for v, width in stored:
                    by_width[width > FIT_BRACKET * (1 + 1e-6)].append(math.log(v) - mid)
        moved = [abs(math.log(rp.new_rps / rp.old_rps)) for rp in earlier if rp.old_rps and rp.new_rps]
        if moved:
            print(f"|  | where the fit alone stops earlier, its rate against the run's: median "
                  f"{statistics.median(moved):.1%}, largest {max(moved):.1%} |  |  |  |  |  |  |")

    print("\n| confirmation runs, stopped with passed and failed | runs | from their config's median (rms) |\n"
          "| --- | --- | --- |")
    for wide, devs in by_width.items():
        rms = math.sqrt(sum(d * d for d in devs) / len(devs)) if devs else math.nan
        print(f"| {'more than' if wide else 'at most'} {FIT_BRACKET:.0%} apart | {len(devs)} | {rms:.1%} |")


if __name__ == "__main__":
    main()
