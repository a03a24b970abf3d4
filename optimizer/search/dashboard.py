"""Trial constraints in both forms readers look for.

Optuna 5 stores `trial.set_constraint(key, value)` as the system attribute `constraints:KEY`. optuna-dashboard (up to
0.21) reads only the older list form, system attribute `constraints` (what Optuna's samplers wrote from a
`constraints_func`), and without it shows every trial as feasible. So each constraint is written both ways. Optuna
reads the list back as constraint "0" beside the named one, with the same value: feasibility (all <= 0) is the same.
"""

from __future__ import annotations

import optuna

DASHBOARD_CONSTRAINTS_ATTR = "constraints"  # optuna-dashboard's _serializer.CONSTRAINTS_KEY


def set_constraint(trial: optuna.Trial, key: str, value: float) -> None:
    """`trial.set_constraint(key, value)`, and the same value as the list optuna-dashboard reads (once per trial:
    a second constraint on the same trial is ignored, as Optuna ignores it)."""
    storage = trial.storage
    trial_id = storage.get_trial_id_from_study_id_trial_number(
        storage.get_study_id_from_name(trial.study.study_name), trial.number)
    already = f"{DASHBOARD_CONSTRAINTS_ATTR}:{key}" in storage.get_trial_system_attrs(trial_id)
    trial.set_constraint(key, value)
    if not already:
        storage.set_trial_system_attr(trial_id, DASHBOARD_CONSTRAINTS_ATTR, [float(value)])
