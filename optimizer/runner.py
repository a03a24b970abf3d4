"""Wire a StudyConfig to a study: model, workload, space, storage, engine, objective; then run to budget."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import optuna

from optimizer.config import StudyConfig
from optimizer.engines.base import EngineFactory
from optimizer.model import DEFAULT_MODEL_NAME, default_model, inspect_model
from optimizer.objective import Objective
from optimizer.preflight import DeviceMemory
from optimizer.records import RecordStore
from optimizer.progress import Progress
from optimizer.space import resolve
from optimizer.study import finished_count, open_study, run_to_budget, storage_for, stored_config
from optimizer.units import format_ms
from optimizer.workload import build_workload


@dataclass
class Prepared:
    config: StudyConfig
    study: optuna.Study
    objective: Objective

    @property
    def finished(self) -> int:
        return finished_count(self.study)


def model_path(config: StudyConfig) -> str:
    """Where the model is: the embedded default is generated on first use."""
    return str(default_model()) if config.model_is_default else config.model


def engine_base_args(config: StudyConfig, path: str) -> dict[str, Any]:
    args: dict[str, Any] = {"model": path, **config.engine_args}
    if config.dummy_weights:
        args["load_format"] = "dummy"
    return args


def vllm_factory(base_args: dict[str, Any]) -> EngineFactory:
    from optimizer.engines.vllm_engine import VllmEngine

    return lambda: VllmEngine(base_args)


def http_factory(base_args: dict[str, Any]) -> EngineFactory:
    from optimizer.engines.http_engine import HttpEngine

    return lambda: HttpEngine(base_args)


def factory_for(config: StudyConfig, path: str) -> EngineFactory:
    """The engine the study's `backend` names, with the study's fixed engine arguments."""
    base = engine_base_args(config, path)
    return http_factory(base) if config.backend == "http" else vllm_factory(base)


def prepare(config: StudyConfig, studies_dir: Path, say: Callable[..., None] = print,
            engine_factory: EngineFactory | None = None,
            memory_probe: Callable[[], DeviceMemory | None] | None = None) -> Prepared:
    """Validate everything a user gave before anything is written, then open (or create) the study."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    path = model_path(config)
    info = inspect_model(path, config.dummy_weights)
    space = resolve(config.space, config.device, info.max_len, config.workload)
    workload = build_workload(config.workload, info.vocab_size)
    if config.model_is_default:
        say(f"model: embedded default {DEFAULT_MODEL_NAME} (Llama architecture, random weights) at {path}")
    scale = " (scaled down for the CPU demo)" if config.model_is_default else ""
    storage = storage_for(config.storage_url)
    pilot_first = config.num_requests_auto and stored_config(storage, config.study_name) is None
    described = config.workload.describe()
    if pilot_first:
        described = described.replace(f"{config.workload.num_requests} requests per replay",
                                      "requests per replay chosen by a pilot")
    say(f"workload{scale}: {described}")
    records = RecordStore(config.storage_url)
    objective = Objective(
        config=config,
        space=space,
        workload=workload,
        engine_factory=engine_factory or factory_for(config, path),
        logs_dir=studies_dir / f"{config.study_name}.logs",
        model=info,
        memory_probe=memory_probe or (lambda: DeviceMemory.probe(config.device)),
        records=records,
    )
    choice = None
    if pilot_first:
        from optimizer.pilot import run_pilot

        # before the study exists: every one of its trials replays the count the pilot chooses
        config, choice = run_pilot(config, storage, objective, records, say)
        objective = replace(objective, config=config, workload=build_workload(config.workload, info.vocab_size))
    study = open_study(config, storage)
    if choice is not None:
        from optimizer.pilot import CHOICE_ATTR

        study.set_user_attr(CHOICE_ATTR, choice.to_dict())
    if config.prescreen and finished_count(study) < config.budget:
        prescreen(config, study, storage, objective, studies_dir, say)
    say(f"study {config.study_name!r}: TTFT P99 <= {format_ms(config.ttft_p99_ms)}, budget {config.budget} trials, "
        f"engine logs in {objective.logs_dir}")
    return Prepared(config, study, objective)


def run(prepared: Prepared, quiet: bool = False) -> optuna.Study:
    """Run trials until the study holds its budget of finished trials."""
    progress = Progress(prepared.study, prepared.config.budget, quiet=quiet)
    try:
        run_to_budget(prepared.study, prepared.objective, prepared.config.budget, on_trial=progress)
    except Exception as exc:
        from optimizer.dbretry import storage_error_in

        lost = storage_error_in(exc)  # the database went away: say so in one line, not as Optuna's UnboundLocalError
        if lost is not None and lost is not exc:
            raise lost from None
        raise
    finally:
        progress.close()
    return prepared.study


def prescreen(config: StudyConfig, study: optuna.Study, storage: optuna.storages.BaseStorage, objective: Objective,
              studies_dir: Path, say: Callable[..., None]) -> None:
    """`--prescreen N`: N simulated trials (study NAME.sim), their best and least certain configs queued first."""
    from optimizer.preflight import DeviceMemory
    from optimizer.prescreen import DEFAULT_DEVICE_MEMORY_BYTES, run_prescreen
    from optimizer.sim.steptime import StepTimeModel

    assert objective.model is not None
    time_model = StepTimeModel.load(config.calibration) if config.calibration else StepTimeModel()
    memory = DeviceMemory.probe(config.device)
    run_prescreen(study, storage, config, objective.space, objective.workload, objective.model, time_model,
                  config.prescreen, logs_dir=studies_dir / f"{config.study_name}.sim.logs",
                  device_memory_bytes=memory.total_bytes if memory else DEFAULT_DEVICE_MEMORY_BYTES, say=say)


def p99_advice(prepared: Prepared, tolerance: float = 0.4) -> str | None:
    """How well the recommendation's replay pinned down TTFT P99, and the replay length that would (stored too).

    The count is advice for the next study, not changed in this one: every trial of a study replays the same
    requests, so that their results compare (`--num-requests auto` chooses it before a study starts).
    """
    from optimizer.report import recommended
    from optimizer.stability import p99_stability

    best = recommended(prepared.study)
    store = prepared.objective.records
    if best is None or store is None:
        return None
    rate = (best.user_attrs.get("result") or {}).get("rate_rps")
    target = math.inf if rate is None else float(rate)
    replays = [recs for r, recs in store.load(prepared.config.study_name, best.number) if math.isclose(r, target)]
    ttft = [1000 * r.ttft_s for r in (replays[-1] if replays else []) if r.ok and r.ttft_s is not None]
    if len(ttft) < 10:
        return None
    s = p99_stability(ttft, tolerance)
    prepared.study.set_user_attr("p99_stability", {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                                                   for k, v in s.__dict__.items()})
    high = "open above" if not math.isfinite(s.high_ms) else f"{s.high_ms:.0f} ms"
    line = (f"TTFT P99 of the recommendation over {s.n} requests: {s.p99_ms:.0f} ms, 95% interval "
            f"[{s.low_ms:.0f} ms, {high}]")
    if s.stable:
        return line + f": stable (within {tolerance:.0%} of it)"
    if s.requests_needed is None:
        return line + ": not stable; its tail is too short to say how many requests would make it so"
    return line + (f": not stable; about {s.requests_needed} requests per replay would pin it within "
                   f"{tolerance:.0%} (--num-requests {s.requests_needed}, or auto, in a new study)")
