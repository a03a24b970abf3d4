"""Trial constraints in both forms readers look for.

Optuna 5 stores `trial.set_constraint(key, value)` as the system attribute `constraints:KEY`. optuna-dashboard (up to
0.21) reads only the older list form, system attribute `constraints` (what Optuna's samplers wrote from a
`constraints_func`), and without it shows every trial as feasible. So each constraint is written both ways. Optuna
reads the list back as constraint "0" beside the named one, with the same value: feasibility (all <= 0) is the same.
"""

from __future__ import annotations

import optuna

from optimizer.config.limits import Limit

DASHBOARD_CONSTRAINTS_ATTR = "constraints"  # optuna-dashboard's _serializer.CONSTRAINTS_KEY


def constraint_key(limit: Limit) -> str:
    """The name of a limit's constraint: 'tpot_p99_over_limit' (its value: measured / limit - 1)."""
    return f"{limit.metric}_{limit.stat}_over_limit"


def set_constraints(trial: optuna.Trial, values: dict[str, float]) -> None:
    """`trial.set_constraint(key, value)` for each, and the values in order as the list optuna-dashboard reads
    (once per trial: a second call on the same trial is ignored, as Optuna ignores it)."""
    storage = trial.storage
    trial_id = storage.get_trial_id_from_study_id_trial_number(
        storage.get_study_id_from_name(trial.study.study_name), trial.number)
    attrs = storage.get_trial_system_attrs(trial_id)
    already = any(f"{DASHBOARD_CONSTRAINTS_ATTR}:{key}" in attrs for key in values)
    for key, value in values.items():
        trial.set_constraint(key, value)
    if not already:
        storage.set_trial_system_attr(trial_id, DASHBOARD_CONSTRAINTS_ATTR, [float(v) for v in values.values()])


def set_constraint(trial: optuna.Trial, key: str, value: float) -> None:
    """One constraint, both ways (`set_constraints`)."""
    set_constraints(trial, {key: value})
