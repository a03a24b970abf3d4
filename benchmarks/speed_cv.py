"""What moves a run's rate at the limit, and what interval covers it? Reads finished real studies (starts nothing)
and refits every stored search trial and confirmation run from its probes' counts, two ways:

1. each probe at its own replay speed, a log-normal random effect of sigma on a grid, integrated in the likelihood
   (`measurement/rate_fit.py::profile`, `speed_cv`; the simulator's model): the counts' marginal log likelihood,
   summed over the fits (each at its own best root and slope), against the grid's best: which sigma the probes
   themselves prefer; and the interval it gives (no re-measurement term);
2. the counts' own interval with each end widened by a re-measurement's sigma in quadrature (`widened`,
   `remeasure_cv`; what the product does, REMEASURE_CV).

For both: the runs' and the search trials' median half-width, and coverage: a confirmation run's interval against
the same config's rate in the other rounds (a fresh engine, another draw, minutes later; how many fell under its low
end and over its high end), and the search trial's interval against its rounds' rates.

    .venv/bin/python benchmarks/speed_cv.py studies/default [DIR/NAME ...] [--sigmas 0,0.02,0.05]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna  # noqa: E402
from fit_point import counts, stored_study  # noqa: E402

from optimizer.measurement.rate_fit import (REMEASURE_CV, ProbeCount, RateAtLimit, fit_rate_at_limit,  # noqa: E402
                                            profile, used_in_fit)
from optimizer.search.confirmed import confirmation  # noqa: E402

SIGMAS = (0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.07, 0.10)
Fit = Callable[[list[ProbeCount], float], "RateAtLimit | None"]


def finite(fit: RateAtLimit | None) -> bool:
    return fit is not None and math.isfinite(fit.high_rps)


def coverage(groups: list, fit: Fit, sigma: float) -> str:
    """One row's half-widths and coverage, every run and search trial fitted by `fit` at `sigma`."""
    run_halves, search_halves, cross, pairs, under, over, own, of = [], [], 0, 0, 0, 0, 0, 0
    for searched, runs in groups:
        fits = [f for r in runs if finite(f := fit(r, sigma))]
        run_halves += [f.half_width for f in fits]
        for a in fits:
            for b in fits:
                if a is not b:
                    pairs += 1
                    cross += a.contains(b.rate_rps)
                    under += b.rate_rps < a.low_rps
                    over += b.rate_rps > a.high_rps
        s = fit(searched, sigma) if searched else None
        if finite(s):
            search_halves.append(s.half_width)
            own += sum(s.contains(f.rate_rps) for f in fits)
            of += len(fits)
    return (f"+-{statistics.median(run_halves):.1%} | +-{statistics.median(search_halves):.1%} | "
            f"{cross}/{pairs} ({cross / max(pairs, 1):.0%}; {under} under, {over} over) | "
            f"{own}/{of} ({own / max(of, 1):.0%}) |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("studies", nargs="+", help="DIR/NAME of a real study (its DIR/NAME.db)")
    p.add_argument("--sigmas", default=",".join(str(s) for s in SIGMAS))
    args = p.parse_args(argv)
    sigmas = [float(s) for s in args.sigmas.split(",")]
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    groups = []  # per config of a confirmation: (search trial's probes, [each round's run's probes])
    for path in args.studies:
        study = stored_study(Path(path))
        c = confirmation(study)
        if c is None:
            print(f"{path}: no confirmation")
            continue
        for x in c.configs:
            runs = [counts(x.runs[r]) for r in sorted(x.runs)]
            groups.append((counts(x.trial), [r for r in runs if r]))
    print(f"{len(groups)} configs, {sum(len(r) for _, r in groups)} confirmation runs; REMEASURE_CV now {REMEASURE_CV}")
    head = ("half-width, runs (median) | search trials (median) | a run's interval covers another round's rate | "
            "the search trial's covers a round's rate |")
    print(f"\n1. each probe at its own speed (no re-measurement term)\n\n| sigma | log likelihood, summed (vs the "
          f"best) | {head}\n| --- | --- | --- | --- | --- | --- |")
    rows = []
    for sigma in sigmas:
        ll = 0.0
        for searched, runs in groups:
            for probes in [searched, *runs]:
                used = used_in_fit(probes) if probes else []
                if used and any(q.over_limit > 0 for q in used) and any(q.over_limit < q.requests for q in used):
                    ll += float(profile(used, speed_cv=sigma)[1].max())
        rows.append((sigma, ll, coverage(groups, lambda r, s: fit_rate_at_limit(r, speed_cv=s, remeasure_cv=0.0),
                                         sigma)))
    best = max(r[1] for r in rows)
    for sigma, ll, row in rows:
        print(f"| {sigma:.3f} | {ll - best:+.1f} | {row}")
    print(f"\n2. the counts' own interval, each end widened by a re-measurement's sigma\n\n| sigma | {head}\n"
          "| --- | --- | --- | --- | --- |")
    for sigma in sigmas:
        print(f"| {sigma:.3f} | {coverage(groups, lambda r, s: fit_rate_at_limit(r, remeasure_cv=s), sigma)}")


if __name__ == "__main__":
    main()
