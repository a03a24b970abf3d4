"""How a run runs trials at once: the slot processes of `--gpus` (search/slots.py) and the Ray cluster of `--ray`
(search/raycluster.py), from the command line's side."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optimizer.core.errors import UsageError

if TYPE_CHECKING:
    from optimizer.config.settings import StudyConfig


def join_ray(address: str, pool: Any, pilot_here: bool) -> Any:
    """Ray, joined to the cluster at `address` (search/raycluster.py `connect`), its tasks carrying this run's id; a
    UsageError naming the fix for --gpus beside it, or for a pilot (`pilot_here`) on a host without a GPU."""
    from optimizer.search.raycluster import connect
    from optimizer.search.recovery import RUN_ENV

    if pool is not None:
        raise UsageError("--ray runs trials on the Ray cluster's GPUs: leave out --gpus (a node's GPUs are the ones it "
                         "was started with: ray start --num-gpus N)")
    if pilot_here:
        from optimizer.hardware.device import visible_gpus

        if not visible_gpus():  # the pilot runs where optimize runs, before any trial
            raise UsageError("--ray: the pilot that chooses the requests per replay runs in this process, which sees "
                             "no GPU: give --num-requests N (e.g. 1000), or run optimize on a node with one")
    os.environ.setdefault(RUN_ENV, uuid.uuid4().hex)  # the run's tasks share its SQLite study
    return connect(address, {RUN_ENV: os.environ[RUN_ENV]})


def run_slot(config: StudyConfig, studies_dir: Path, pool: Any) -> int:
    """A slot (search/slots.py): the study its run opened, search trials on the pool until the budget holds them,
    each trial started under the run's budget lock; nothing on the console (its output is the slot's log)."""
    from optimizer.search.budget import run_to_budget
    from optimizer.search.confirm import run_estimate_s
    from optimizer.search.runner import prepare, trial_estimate
    from optimizer.search.slots import BudgetGate, gate_path
    from optimizer.search.split import plan

    prepared = prepare(config, studies_dir, live=False, slot=True)
    prepared.objective.gpu_pool = pool
    split = plan(config.budget, config.confirm, config.serves_after)
    run_to_budget(prepared.study, prepared.objective, split.search_budget, deadline_unix_s=config.deadline_unix_s,
                  trial_estimate_s=trial_estimate(prepared), gate=BudgetGate(gate_path(prepared.objective.logs_dir)),
                  reserve_s=lambda: split.runs * (run_estimate_s(prepared.study) or 0.0),  # the confirmation's time
                  wait_running_s=config.trial_timeout_s)
    return 0


def slot_argv(argv: list[str]) -> list[str]:
    """Pure: the run's command line for its slots, without --budget: a slot reads the budget and deadline the run
    stored with the study (a duration given again would end later)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--budget":
            skip = True
        elif not arg.startswith("--budget="):
            out.append(arg)
    return out
