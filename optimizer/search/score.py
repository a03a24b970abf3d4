"""One definition of a trial's score and of the recommendation, read from the values Optuna stores."""

from __future__ import annotations

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer.search.study import is_baseline


def feasible(trial: FrozenTrial) -> bool:
    return trial.state == TrialState.COMPLETE and all(v <= 0 for v in trial.constraints.values())


def throughput(trial: FrozenTrial) -> float:
    return float(trial.values[0]) if trial.values else float("nan")


def recommended(study: optuna.Study) -> FrozenTrial | None:
    """The feasible trial with the highest output throughput (ties: lower TTFT P99)."""
    candidates = [t for t in study.get_trials(deepcopy=False) if feasible(t)]
    if not candidates:
        return None
    return max(candidates, key=lambda t: (t.values[0], -t.values[1]))


def baseline(study: optuna.Study) -> FrozenTrial | None:
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        if is_baseline(t):
            return t
    return None
