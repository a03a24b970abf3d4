"""Does the rate to provision for hold one more run? Leave one round out over finished studies' confirmations.

    .venv/bin/python benchmarks/provision_coverage.py DIR/NAME [DIR/NAME ...]

For each stored study (`DIR/NAME.db`, as `optimize --studies-dir DIR --study NAME` left it) and each of its full
confirmation rounds k: every config's rate to provision for is computed as `optimize report` computes it
(decision/served.py::provision_rps: the geometric mean of its rounds times `lower_prediction_factor`, the one-sided 95%
lower prediction bound from the spread of every config's rounds), from the other rounds alone, and compared with the
config's rate at the limit in round k, which that bound never saw: a run on the same machine, minutes later, on
another draw. About 19 in 20 should lie at or above it. With one round left out of three, each bound rests on two
rounds, so it is wider than a study's own. The rounds of one study share their minutes (a slow minute moves every
config of its round), so the checks of one round are not independent.

Reads the studies only; starts no engine.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna  # noqa: E402

from optimizer.measurement.intervals import geometric_mean, lower_prediction_factor  # noqa: E402
from optimizer.search.confirmed import confirmation  # noqa: E402
from optimizer.search.study import storage_for  # noqa: E402


def checks(where: Path) -> list[tuple[int, int, float, float]]:
    """(round left out, config, its rate at the limit in that round, its rate to provision for from the others)."""
    study = optuna.load_study(study_name=where.name,
                              storage=storage_for(f"sqlite:///{where.with_name(where.name + '.db').resolve()}"))
    c = confirmation(study)
    if c is None or len(c.full_rounds) < 3:
        print(f"{where}: no confirmation of 3 rounds or more: skipped")
        return []
    rates = {x.number: {r: v for r in c.full_rounds if (v := x.rate_rps(r)) is not None} for x in c.configs}
    print(f"{where}: rates at the limit in process by round: "
          + "; ".join(f"#{n} " + ", ".join(f"{v:.2f}" for v in got.values()) for n, got in rates.items()))
    out = []
    for k in c.full_rounds:
        rows = {n: [v for r, v in got.items() if r != k] for n, got in rates.items()}
        for n, got in rates.items():
            own = rows[n]
            factor = lower_prediction_factor(list(rows.values()), len(own))
            if k in got and factor is not None and own and all(0 < v < math.inf for v in own):
                out.append((k, n, got[k], geometric_mean(own) * factor))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("studies", nargs="+", help="DIR/NAME of a finished study (its database is DIR/NAME.db)")
    args = p.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    held = total = 0
    for name in args.studies:
        for k, n, rate, bound in checks(Path(name)):
            total += 1
            held += rate >= bound
            print(f"  round {k} left out: #{n} {rate:.2f} req/s, to provision for {bound:.2f} "
                  f"({rate / bound - 1:+.0%}){'' if rate >= bound else '  BELOW'}")
    print(f"rounds left out at or above their rate to provision for: {held} of {total}"
          + (f" ({held / total:.0%}; aim: 95%)" if total else ""))


if __name__ == "__main__":
    main()
