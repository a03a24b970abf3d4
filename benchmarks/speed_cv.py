"""How fast does one engine's speed move from one replay to the next? Reads finished real studies (starts nothing) and
refits every stored trial and confirmation run from its probes' counts with each replay-speed sigma on a grid
(`measurement/rate_fit.py`: REPLAY_SPEED_CV, the log-normal sigma of the speed each probe's replay ran at):

- the counts' marginal log likelihood, summed over the fits (each at its own best root and slope), against the
  grid's best: which sigma the probes themselves prefer;
- the runs' and the search trials' median half-width;
- coverage: a confirmation run's interval against the same config's rate in the other rounds (a fresh engine,
  another draw, minutes later), and the search trial's interval against its rounds' rates.

    .venv/bin/python benchmarks/speed_cv.py /tmp/demo17/studies/default [...] [--sigmas 0,0.02,0.05]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna  # noqa: E402
from fit_point import counts, stored_study  # noqa: E402

from optimizer.measurement.rate_fit import (REPLAY_SPEED_CV, RateAtLimit, fit_rate_at_limit, profile,  # noqa: E402
                                            used_in_fit)
from optimizer.search.confirmed import confirmation  # noqa: E402

SIGMAS = (0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.07, 0.10)


def finite(fit: RateAtLimit | None) -> bool:
    return fit is not None and math.isfinite(fit.high_rps)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("studies", nargs="+", help="DIR/NAME of a real study (its DIR/NAME.db)")
    p.add_argument("--sigmas", default=",".join(str(s) for s in SIGMAS))
    args = p.parse_args(argv)
    sigmas = [float(s) for s in args.sigmas.split(",")]
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    groups = []  # per config of a confirmation: (search trial's probes, [each round's run's probes])
    for path in args.studies:
        where = Path(path)
        study = stored_study(where)
        c = confirmation(study)
        if c is None:
            print(f"{path}: no confirmation")
            continue
        for x in c.configs:
            runs = [counts(x.runs[r]) for r in sorted(x.runs)]
            groups.append((counts(x.trial), [r for r in runs if r]))
    print(f"{len(groups)} configs, {sum(len(r) for _, r in groups)} confirmation runs; "
          f"REPLAY_SPEED_CV now {REPLAY_SPEED_CV}")
    print("| sigma | log likelihood, summed (vs the best) | half-width, runs (median) | search trials (median) | "
          "a run's interval covers another round's rate | the search trial's covers a round's rate |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows = []
    for sigma in sigmas:
        ll, run_halves, search_halves, cross, pairs, own, of = 0.0, [], [], 0, 0, 0, 0
        for searched, runs in groups:
            for probes in [searched, *runs]:
                used = used_in_fit(probes) if probes else []
                if used and any(q.over_limit > 0 for q in used) and any(q.over_limit < q.requests for q in used):
                    ll += float(profile(used, speed_cv=sigma)[1].max())
            fits = [fit_rate_at_limit(r, speed_cv=sigma) for r in runs]
            fits = [f for f in fits if finite(f)]
            run_halves += [f.half_width for f in fits]
            for a in fits:
                for b in fits:
                    if a is not b:
                        pairs += 1
                        cross += a.contains(b.rate_rps)
            s = fit_rate_at_limit(searched, speed_cv=sigma) if searched else None
            if finite(s):
                search_halves.append(s.half_width)
                own += sum(s.contains(f.rate_rps) for f in fits)
                of += len(fits)
        rows.append((sigma, ll, run_halves, search_halves, cross, pairs, own, of))
    best = max(r[1] for r in rows)
    for sigma, ll, run_halves, search_halves, cross, pairs, own, of in rows:
        print(f"| {sigma:.2f} | {ll - best:+.1f} | +-{statistics.median(run_halves):.1%} | "
              f"+-{statistics.median(search_halves):.1%} | {cross}/{pairs} ({cross / max(pairs, 1):.0%}) | "
              f"{own}/{of} ({own / max(of, 1):.0%}) |")


if __name__ == "__main__":
    main()
