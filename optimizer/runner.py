"""Wire a StudyConfig to a study: model, workload, space, storage, engine, objective; then run to budget."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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
from optimizer.study import finished_count, open_study, run_to_budget, storage_for
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
        w = config.workload
        say(f"workload: chat traffic scaled down for the CPU demo: inputs {w.input_len_min}-{w.input_len_max}, "
            f"outputs {w.output_len_min}-{w.output_len_max} tokens, {w.num_requests} requests per replay")
    study = open_study(config, storage_for(config.storage_url))
    objective = Objective(
        config=config,
        space=space,
        workload=workload,
        engine_factory=engine_factory or vllm_factory(engine_base_args(config, path)),
        logs_dir=studies_dir / f"{config.study_name}.logs",
        model=info,
        memory_probe=memory_probe or (lambda: DeviceMemory.probe(config.device)),
        records=RecordStore(config.storage_url),
    )
    say(f"study {config.study_name!r}: TTFT P99 <= {format_ms(config.ttft_p99_ms)}, budget {config.budget} trials, "
        f"engine logs in {objective.logs_dir}")
    return Prepared(config, study, objective)


def run(prepared: Prepared, quiet: bool = False) -> optuna.Study:
    """Run trials until the study holds its budget of finished trials."""
    progress = Progress(prepared.study, prepared.config.budget, quiet=quiet)
    try:
        run_to_budget(prepared.study, prepared.objective, prepared.config.budget, on_trial=progress)
    finally:
        progress.close()
    return prepared.study
