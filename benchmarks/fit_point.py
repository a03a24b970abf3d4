"""Where does a stored fit place the rate at the limit, against its own probes? Reads finished real studies (starts
nothing): for every search trial and confirmation run that stored its probes' counts, the stored rate at the limit
against the lowest rate at which a probe had more than 5% of its requests over, and against the counts' own most
likely root (`measurement/rate_fit.py`: the likelihood without the replays' speed, how the product places the
rate); per study, the block design's residual spread of the confirmation's runs (log rate, config + round
removed) by each point.

    .venv/bin/python benchmarks/fit_point.py studies/default [DIR/NAME ...]
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import optuna  # noqa: E402

from optimizer.measurement.rate_fit import ProbeCount, fit_rate_at_limit  # noqa: E402
from optimizer.measurement.rate_search import CurvePoint, probe_counts  # noqa: E402
from optimizer.search.measured import measurement_of  # noqa: E402
from optimizer.search.confirmed import confirmation  # noqa: E402
from optimizer.search.study import confirmation_study  # noqa: E402

PAST = 0.05  # a probe with more than this share of its requests over is well past the limit


FIELDS = {f.name for f in dataclasses.fields(CurvePoint)}


def curve_points(trial) -> list[CurvePoint]:
    """The trial's stored curve as `CurvePoint`s, in the order its replays ran (a burst's rate: inf)."""
    m = measurement_of(trial)
    return [CurvePoint(**{**{k: v for k, v in d.items() if k in FIELDS},
                          "offered_rate_rps": d.get("offered_rate_rps") or math.inf})
            for d in (m.curve if m is not None else ())]


def counts(trial) -> list[ProbeCount]:
    """The trial's probes as its fit counted them (`rate_search.probe_counts`: a probe that fell behind counts every
    request as over), from its stored curve."""
    return probe_counts(curve_points(trial))


def counts_root(probes: list[ProbeCount]) -> float | None:
    """The counts' own most likely root, as `fit_rate_at_limit` places the rate now; None where the fit has none or
    only a lower bound."""
    fit = fit_rate_at_limit(probes, resamples=0)
    return fit.rate_rps if fit is not None and math.isfinite(fit.high_rps) else None


def stored_study(where: Path) -> optuna.Study:
    """The study at DIR/NAME: NAME in DIR/NAME.db (a studies dir's layout)."""
    url = f"sqlite:///{where.with_name(where.name + '.db').resolve()}"
    return optuna.load_study(study_name=where.name, storage=url)


def residual_sd(rows: list[list[float]]) -> float:
    """The residual standard deviation of log values after config and round effects (rows: configs x rounds)."""
    y = np.log(np.array(rows))
    res = y - y.mean(1, keepdims=True) - y.mean(0, keepdims=True) + y.mean()
    return math.sqrt(float((res ** 2).sum()) / ((len(rows) - 1) * (len(rows[0]) - 1)))


def main() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    above, past, shifts = 0, 0, []
    for path in sys.argv[1:]:
        where = Path(path)
        study = stored_study(where)
        home = confirmation_study(study)
        for t in study.trials + ([] if home is None else home.trials):
            m, probes = measurement_of(t), counts(t)
            fit = None if m is None or m.rate_at_limit is None else m.rate_at_limit.to_dict()
            if not fit or not probes:
                continue
            failed = [p.rate_rps for p in probes if p.over_limit > PAST * p.requests]
            if failed:
                past += 1
                above += fit["rate_rps"] > min(failed)
            root = counts_root(probes)
            if root:
                shifts.append(fit["rate_rps"] / root - 1)
        c = confirmation(study)
        if c is None or len(c.full_rounds) < 2:
            continue
        stored = [[fit.rate_rps if (m := measurement_of(x.runs[r])) is not None and (fit := m.rate_at_limit)
                   is not None else None for r in c.full_rounds]
                  for x in c.configs if all(r in x.runs for r in c.full_rounds)]
        refit = [[counts_root(counts(x.runs[r])) for r in c.full_rounds]
                 for x in c.configs if all(r in x.runs for r in c.full_rounds)]
        if all(v for row in stored + refit for v in row):
            print(f"{path}: {len(c.full_rounds)} rounds; residual spread of log rate: stored points "
                  f"{residual_sd(stored):.3f}, the counts' own roots {residual_sd(refit):.3f}")
    if shifts:
        shifts.sort()
        print(f"stored rate above the lowest rate with more than {PAST:.0%} over: {above} of {past}; stored rate over "
              f"the counts' own root: median {statistics.median(shifts):+.1%}, 90th percentile "
              f"{shifts[int(0.9 * len(shifts))]:+.1%}, at most {shifts[-1]:+.1%} ({len(shifts)} fits)")


if __name__ == "__main__":
    main()
