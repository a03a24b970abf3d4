"""Pre-screen on the simulator: many cheap simulated trials first, then real trials where they matter most.

`optimize --prescreen N` runs N trials of the study's own sampler and objective on the simulated engine (virtual
time: a trial costs a fraction of a second and no engine minutes), in a sibling study `NAME.sim` in the same
storage. Into the real study, right after vLLM's defaults, it queues:

- the *top* configs of the simulated study (highest simulated goodput), and
- the configs the simulator is *least sure* of: the next candidates are simulated again under time models
  perturbed by the calibration's typical error (each coefficient scaled by exp(N(0, sigma))); the ones with the
  highest optimistic goodput (mean + one standard deviation over the perturbations) are queued. This favours
  configs that could be the best if the simulator is off, which is where a real measurement is worth most.

Then the normal sampler goes on; it learns from the queued real trials like from any other. The real budget is
unchanged: queued trials count against it. A study is pre-screened once (the choice is stored with it).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.trial import FrozenTrial

from optimizer.config.model import ModelInfo
from optimizer.config.settings import StudyConfig
from optimizer.engines.sim.noise import NoiseSource
from optimizer.engines.sim.steptime import StepTimeModel
from optimizer.engines.simulated import SimulatedEngine
from optimizer.measurement.workload import Workload
from optimizer.params.preflight import GIB
from optimizer.params.space import Space
from optimizer.search.attrs import BASELINE, PRESCREEN, SIM_GOODPUT_TOK_S, STUDY_PRESCREEN
from optimizer.search.objective import Objective
from optimizer.search.score import goodput

SIM_SUFFIX = ".sim"
DEFAULT_DEVICE_MEMORY_BYTES = 24 * GIB
PERTURB_SIGMA = 0.25  # log-scale spread of each step-time coefficient: the simulator's assumed error
ENGINE_LIFECYCLE_FIELDS = ("engine_start_s", "engine_shutdown_s")  # not perturbed: they do not rank configs


@dataclass(frozen=True)
class Pick:
    """One config queued into the real study, and why."""

    params: dict[str, Any]
    reason: str  # "top" or "unsure"
    sim_goodput_tok_s: float  # on the pre-screen's time model
    optimistic_tok_s: float | None = None  # mean + std over perturbed time models ("unsure" candidates only)
    spread: float | None = None  # std / mean over perturbed time models


def sim_objective(config: StudyConfig, space: Space, workload: Workload, model: ModelInfo,
                  time_model: StepTimeModel, logs_dir: Path, device_memory_bytes: int = DEFAULT_DEVICE_MEMORY_BYTES,
                  early_stop: bool = True, on_engine: Callable[[SimulatedEngine], None] | None = None,
                  noise: NoiseSource | None = None, device_name: str = "") -> Objective:
    """The study's objective with the simulated engine behind it (no records stored, no memory probe).

    `noise` (shared by every engine it makes) gives the engines a shared machine's run-to-run noise and drift;
    `device_name` (a GPU's, as NVML names it) and the study's `deploy_as` pick vLLM's defaults as the real start does.
    """

    def factory() -> SimulatedEngine:
        engine = SimulatedEngine(model, time_model, config.device, device_memory_bytes, noise=noise,
                                 deploy_as=config.deploy_as, device_name=device_name)
        if on_engine is not None:
            on_engine(engine)
        return engine

    return Objective(config=config, space=space, workload=workload, engine_factory=factory, logs_dir=logs_dir,
                     early_stop=early_stop)


def evaluate(objective: Objective, params_list: Sequence[dict[str, Any]],
             callbacks: Sequence[Callable[[optuna.Study, FrozenTrial], None]] = ()) -> list[FrozenTrial]:
    """Each parameter set measured alone (no incumbent, so no early stop), in a throwaway in-memory study.

    Every searched parameter must be given: one left out would be sampled at random.
    """
    objective = replace(objective, early_stop=False)
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(0))
    for params in params_list:
        study.enqueue_trial(params, skip_if_exists=False)
    study.optimize(objective, n_trials=len(params_list), catch=(), gc_after_trial=False, callbacks=list(callbacks))
    return study.trials


def perturbed(model: StepTimeModel, count: int, sigma: float = PERTURB_SIGMA, seed: int = 0) -> list[StepTimeModel]:
    """`count` time models around `model`, each step-time coefficient scaled by exp(N(0, sigma)); deterministic."""
    rng = np.random.default_rng(seed)
    terms = [f.name for f in fields(model) if f.name not in ENGINE_LIFECYCLE_FIELDS]  # every per-step cost
    return [replace(model, **{f: getattr(model, f) * float(math.exp(rng.normal(0.0, sigma))) for f in terms})
            for _ in range(count)]


def choose(trials: Sequence[FrozenTrial], top_k: int, unsure_k: int,
           evaluate_under: Callable[[list[dict[str, Any]]], list[list[float]]] | None,
           candidates: int = 8) -> list[Pick]:
    """The top `top_k` simulated configs, then `unsure_k` more of the next `candidates` by optimistic goodput.

    `evaluate_under(params_list)` gives, per perturbed time model, the goodput of each parameter set.
    Distinct parameter sets only; the baseline (vLLM's defaults, already queued first) is never picked.
    """
    ranked: list[FrozenTrial] = []
    seen: set[str] = set()
    for t in sorted(trials, key=goodput, reverse=True):
        key = repr(sorted(t.params.items()))
        if goodput(t) <= 0 or BASELINE.of(t) or not t.params or key in seen:
            continue
        seen.add(key)
        ranked.append(t)
    picks = [Pick(dict(t.params), "top", goodput(t)) for t in ranked[:top_k]]
    rest = ranked[top_k:top_k + candidates]
    if unsure_k <= 0 or not rest or evaluate_under is None:
        return picks
    per_model = np.asarray(evaluate_under([dict(t.params) for t in rest]), dtype=float)  # models x candidates
    mean, std = per_model.mean(axis=0), per_model.std(axis=0)
    optimistic = mean + std
    for i in np.argsort(-optimistic, kind="stable")[:unsure_k]:
        t = rest[int(i)]
        picks.append(Pick(dict(t.params), "unsure", goodput(t), float(optimistic[i]),
                          float(std[i] / mean[i]) if mean[i] > 0 else None))
    return picks


def run_prescreen(study: optuna.Study, storage: optuna.storages.BaseStorage, config: StudyConfig, space: Space,
                  workload: Workload, model: ModelInfo, time_model: StepTimeModel, n_trials: int,
                  logs_dir: Path | None = None, top_k: int = 3, unsure_k: int = 2, perturbations: int = 6,
                  device_memory_bytes: int = DEFAULT_DEVICE_MEMORY_BYTES, device_name: str = "",
                  say: Callable[..., None] = lambda *a: None) -> list[Pick]:
    """Pre-screen `study` once: simulate `n_trials` in study NAME.sim, queue the picks into `study`.

    Returns the picks (empty when the study was pre-screened before: resuming never queues them again).
    """
    from optimizer.search.budget import run_to_budget, wait_while_running
    from optimizer.search.study import open_study

    if STUDY_PRESCREEN.of(study) is not None:
        return []
    logs = logs_dir or Path(tempfile.mkdtemp(prefix="prescreen-"))
    sim_config = config.model_copy(update={"study_name": config.study_name + SIM_SUFFIX, "budget": n_trials,
                                             "prescreen": 0})
    sim_study = open_study(sim_config, storage)
    objective = sim_objective(sim_config, space, workload, model, time_model, logs, device_memory_bytes,
                              device_name=device_name)
    run_to_budget(sim_study, objective, n_trials, gc_after_trial=False)
    wait_while_running(sim_study, timeout_s=600.0)  # another worker's share of the simulated trials: choose from all

    def evaluate_under(params_list: list[dict[str, Any]]) -> list[list[float]]:
        return [[goodput(t) for t in evaluate(sim_objective(sim_config, space, workload, model, tm, logs,
                                                            device_memory_bytes, device_name=device_name),
                                              params_list)]
                for tm in perturbed(time_model, perturbations, seed=config.seed)]

    picks = choose(sim_study.get_trials(deepcopy=False), top_k, unsure_k, evaluate_under)
    for pick in picks:
        # skip_if_exists: two workers that start a study together both pre-screen (the same simulated trials,
        # so the same picks); the second finds the first's picks queued and adds none
        study.enqueue_trial(pick.params, user_attrs={**PRESCREEN.item(pick.reason),
                                                     **SIM_GOODPUT_TOK_S.item(round(pick.sim_goodput_tok_s, 1))},
                            skip_if_exists=True)
    STUDY_PRESCREEN.set(study, {"sim_study": sim_config.study_name, "sim_trials": n_trials,
                                "time_model": time_model.to_dict(),
                                "picks": [asdict(p) for p in picks]})
    best = max((p.sim_goodput_tok_s for p in picks), default=0.0)
    say(f"pre-screen: {n_trials} simulated trials in study {sim_config.study_name!r}; queued {len(picks)} configs "
        f"({sum(p.reason == 'top' for p in picks)} top, {sum(p.reason == 'unsure' for p in picks)} where the "
        f"simulator is least sure), best simulated {best:.0f} tok/s")
    return picks


def prescreen_study(config: StudyConfig, study: optuna.Study, storage: optuna.storages.BaseStorage,
                    objective: Objective, studies_dir: Path, say: Callable[..., None]) -> None:
    """`--prescreen N`: N simulated trials (study NAME.sim), their best and least certain configs queued first."""
    from optimizer.params.preflight import DeviceMemory

    assert objective.model is not None
    time_model = StepTimeModel.load_or_nominal(config.calibration)
    memory = DeviceMemory.probe(config.device)
    run_prescreen(study, storage, config, objective.space, objective.workload, objective.model, time_model,
                  config.prescreen, logs_dir=studies_dir / f"{config.study_name}.sim.logs",
                  device_memory_bytes=memory.total_bytes if memory else DEFAULT_DEVICE_MEMORY_BYTES,
                  device_name=objective.gpu_name, say=say)
