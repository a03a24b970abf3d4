"""Where a study's time goes: engine start, replays, shutdown and the tool's own overhead, per trial.

    .venv/bin/python benchmarks/trial_timing.py --study default [--storage URL]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import optuna
from optuna.trial import TrialState

from optimizer.search.attrs import TIMINGS
from optimizer.search.measured import measurement_of

KEYS = ("engine_start_s", "replay_s", "engine_shutdown_s", "overhead_s", "total_s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--study", default="default")
    p.add_argument("--storage", help="default: sqlite:///studies/STUDY.db")
    args = p.parse_args()
    url = args.storage or f"sqlite:///{Path('studies', args.study + '.db').resolve()}"
    study = optuna.load_study(study_name=args.study, storage=url)
    rows = [t for t in study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED)) if TIMINGS.of(t)]
    pruned_fast = [t for t in study.get_trials(states=(TrialState.PRUNED,)) if not TIMINGS.of(t)]
    print(f"study {args.study!r}: {len(rows)} trials that started an engine, {len(pruned_fast)} rejected before any "
          f"start (preflight)")
    print(f"{'':>18}" + "".join(f"{k:>19}" for k in KEYS))
    for label, fn in (("median", np.median), ("mean", np.mean), ("max", np.max)):
        vals = [fn([TIMINGS.of(t)[k] for t in rows]) if rows else float("nan") for k in KEYS]
        print(f"{label:>18}" + "".join(f"{v:>19.1f}" for v in vals))
    replays = [len(m.curve) if (m := measurement_of(t)) is not None else 0 for t in rows]
    if replays:
        print(f"replays per trial: median {np.median(replays):.0f}, max {max(replays)}; "
              f"study wall time (sum of trials) {sum(TIMINGS.of(t)['total_s'] for t in rows) / 60:.1f} min")


if __name__ == "__main__":
    main()
