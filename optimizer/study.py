"""Create, load and resume a study; run it to its budget of finished trials.

The resolved StudyConfig is stored with the study, so `optimize --study NAME` resumes with no flags repeated.
The budget counts finished trials (COMPLETE or PRUNED); a trial that crashed or was interrupted does not count
and its work is redone.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer.config import StudyConfig
from optimizer.errors import UsageError

CONFIG_ATTR = "optimizer_config"
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
DIRECTIONS = ["maximize", "minimize"]  # output throughput (tok/s), TTFT P99 (ms) at the best sustained rate


def default_storage_url(study_name: str, studies_dir: Path) -> str:
    return f"sqlite:///{(studies_dir / f'{study_name}.db').resolve()}"


def redact(url: str) -> str:
    """The URL with any password replaced, for messages and logs."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<storage URL>"


def storage_for(url: str) -> optuna.storages.BaseStorage:
    """Open the storage, or fail with a message that names the fix (the password never printed)."""
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return optuna.storages.RDBStorage(url, heartbeat_interval=None)
    except Exception as exc:
        raise UsageError(f"cannot open storage {redact(url)} ({type(exc).__name__}): check the URL (e.g. "
                         f"sqlite:///studies/NAME.db or postgresql://user:pass@host/db) and that the "
                         f"database is reachable") from None


def stored_config(storage: optuna.storages.BaseStorage, study_name: str) -> StudyConfig | None:
    """The config stored with an existing study, or None when no such study exists."""
    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:
        return None
    raw = study.user_attrs.get(CONFIG_ATTR)
    if raw is None:
        raise UsageError(f"study {study_name!r} exists but was not made by optimize: choose another --study name")
    return StudyConfig.model_validate(json.loads(raw))


def sampler(seed: int) -> optuna.samplers.BaseSampler:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True)


def open_study(config: StudyConfig, storage: optuna.storages.BaseStorage) -> optuna.Study:
    """Create the study (with its baseline queued first) or load it to resume."""
    try:
        study = optuna.load_study(study_name=config.study_name, storage=storage, sampler=sampler(config.seed))
    except KeyError:
        study = optuna.create_study(study_name=config.study_name, storage=storage, directions=DIRECTIONS,
                                    sampler=sampler(config.seed))
        study.set_user_attr(CONFIG_ATTR, config.model_dump_json())
    else:
        study.set_user_attr(CONFIG_ATTR, config.model_dump_json())  # a larger budget is the only change allowed
    ensure_baseline(study)
    return study


def is_baseline(trial: FrozenTrial) -> bool:
    return bool(trial.user_attrs.get("baseline"))


def ensure_baseline(study: optuna.Study) -> None:
    """Queue vLLM's defaults unless a baseline finished or is already queued or running."""
    for t in study.get_trials(deepcopy=False):
        if is_baseline(t) and t.state in (*FINISHED, TrialState.WAITING, TrialState.RUNNING):
            return
    study.enqueue_trial({}, user_attrs={"baseline": True}, skip_if_exists=False)


def finished_count(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=FINISHED))


def run_to_budget(study: optuna.Study, objective: Callable[[optuna.Trial], Any], budget: int,
                  on_trial: Callable[[optuna.Study, FrozenTrial], None] | None = None) -> int:
    """Run trials one by one until the study holds `budget` finished trials. Returns how many ran here."""
    ran = 0
    callbacks = [lambda s, t: on_trial(s, t)] if on_trial else []
    while finished_count(study) < budget:
        study.optimize(objective, n_trials=1, callbacks=callbacks, catch=(), gc_after_trial=True)
        ran += 1
    return ran
