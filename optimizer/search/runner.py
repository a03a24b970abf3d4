"""Wire a StudyConfig to a study: model, workload, space, storage, engine, objective; then run to budget."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import FrozenTrial

from optimizer.config.demo import GPU_DEMO_NAME, embedded_model
from optimizer.config.model import ModelInfo, inspect_model
from optimizer.engines.vllm_config import model_defaults
from optimizer.config.settings import StudyConfig
from optimizer.hardware.device import gpu_name, installed_build, version_line
from optimizer.hardware.machine import describe, fingerprint
from optimizer.measurement.engine import EngineFactory
from optimizer.measurement.workload import build_workload
from optimizer.params.preflight import DeviceMemory
from optimizer.params.space import resolve
from optimizer.search.attrs import (
    STUDY_CREATED, STUDY_DEMO_SCALE, STUDY_MACHINE, STUDY_P99_STABILITY, STUDY_REQUESTS_CHOICE, TIMINGS,
)
from optimizer.search.budget import run_to_budget, trials_at_once
from optimizer.search.fitting import machine_warning, served_dtype, size_demo
from optimizer.search.gpu_demo import model_line as gpu_demo_line
from optimizer.search.measured import measurement_of
from optimizer.search.objective import Objective
from optimizer.search.progress import Progress, Status, Tally, Ticker, clock_text, describe as describe_trial
from optimizer.search.records import RecordStore
from optimizer.search.study import finished_count, is_confirmation, open_study, storage_for, stored_config

if TYPE_CHECKING:
    from optimizer.search.budget import Cluster
    from optimizer.search.slots import Slot


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
    return str(embedded_model(config.model)) if config.model_is_default else config.model


def engine_base_args(config: StudyConfig, path: str) -> dict[str, Any]:
    args: dict[str, Any] = {"model": path, **config.engine_args}
    if config.dummy_weights:
        args["load_format"] = "dummy"
    return args


def read_model(config: StudyConfig, path: str, real_engine: bool = True) -> ModelInfo:
    """The model as the study sees it: its config.json (config/model.py), with the longest max_model_len and the MLA
    the installed vLLM accepts and resolves for it where the trials start vLLM (`real_engine`)."""
    info = inspect_model(path, config.dummy_weights)
    facts = model_defaults(engine_base_args(config, path), info.max_len) if real_engine else None
    return info if facts is None else replace(info, max_len=facts[0], mla=facts[1])


def vllm_factory(base_args: dict[str, Any], deploy_as: str = "serve", warm_starts: bool = True) -> EngineFactory:
    from optimizer.engines.vllm_engine import VllmEngine

    return lambda: VllmEngine(base_args, deploy_as=deploy_as, warm_starts=warm_starts)


def http_factory(base_args: dict[str, Any]) -> EngineFactory:
    from optimizer.engines.http_engine import HttpEngine

    return lambda: HttpEngine(base_args)


def sim_factory(config: StudyConfig, info: ModelInfo) -> EngineFactory:
    """The simulated engine (`--engine sim`) for the study's model, on logical GPUs: the nominal step-time model, or
    the study's calibration."""
    from optimizer.engines.sim.steptime import StepTimeModel
    from optimizer.engines.simulated import on_logical_gpu

    time_model = StepTimeModel.load_or_nominal(config.calibration)
    return lambda: on_logical_gpu(info, time_model, config.device, config.deploy_as)


def factory_for(config: StudyConfig, path: str) -> EngineFactory:
    """The engine the study's `backend` names, with the study's fixed engine arguments."""
    base = engine_base_args(config, path)
    return http_factory(base) if config.backend == "http" else vllm_factory(base, config.deploy_as,
                                                                            config.warm_starts)


def served_factory_for(config: StudyConfig, path: str) -> EngineFactory:
    """`vllm serve` with the study's fixed engine arguments: the confirmation's runs as served."""
    return http_factory(engine_base_args(config, path))


def prepare(config: StudyConfig, studies_dir: Path, say: Callable[..., None] = print,
            engine_factory: EngineFactory | None = None,
            memory_probe: Callable[[], DeviceMemory | None] | None = None,
            served_factory: EngineFactory | None = None, live: bool | None = None, slot: bool = False) -> Prepared:
    """Validate everything a user gave before anything is written, then open (or create) the study. The runs as
    served go to `served_factory` (default: `vllm serve` with the study's engine arguments, when the study's
    `serves_after`; none with an `engine_factory` given and no `served_factory`). The steps before the first trial
    (probe, pilot, pre-screen) tick on a terminal (search/progress.py `Ticker`); `live=False`: never. A `slot`
    (one of a run's processes under --gpus, or a trial's task on a cluster under --ray) joins the study its run
    opened: no recovery and no pre-screen of its own."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    path = model_path(config)
    simulated = config.engine == "sim"
    info = read_model(config, path, engine_factory is None and not simulated)
    # bad input fails before any write
    resolve(config.space, config.device, info.max_len, config.workload, info.mla, config.engine_args)
    storage = storage_for(config.storage_url)
    new_study = stored_config(storage, config.study_name) is None
    if engine_factory is None and not simulated and (line := version_line(installed_build())):  # the installed vLLM
        say(line)
    logs_dir = studies_dir / f"{config.study_name}.logs"
    fitted: dict[str, Any] = {}
    if new_study:  # fitted to this machine once, stored with the study: a resume keeps it
        config, fitted = fit_to_machine(config, info, engine_factory, logs_dir, say, live)
        path = model_path(config)
        info = read_model(config, path, engine_factory is None and not simulated)
    info = info.served_as(config.engine_args.get("dtype") or config.space.fixed.get("dtype"))
    space = resolve(config.space, config.device, info.max_len, config.workload, info.mla, config.engine_args)
    workload = build_workload(config.workload, info.vocab_size)
    gpu_demo = config.model_is_default and config.model == GPU_DEMO_NAME  # config/demo.py
    if gpu_demo:
        say(gpu_demo_line(config, path, new_study))
    elif config.model_is_default:
        say(f"model: embedded default {config.model} (Llama architecture, random weights) at {path}")
    scale = " (scaled down for the CPU demo)" if config.model_is_default and not gpu_demo else ""
    pilot_first = config.num_requests_auto and new_study
    described = config.workload.describe()
    if pilot_first:
        described = described.replace(f"{config.workload.num_requests} requests per replay",
                                      "requests per replay chosen by a pilot")
    say(f"workload{scale}: {described}")
    records = RecordStore(config.storage_url)
    if config.serves_after and served_factory is None and engine_factory is None:
        served_factory = served_factory_for(config, path)
    if simulated and engine_factory is None:  # its engine checks its logical GPUs' memory itself
        engine_factory, memory_probe = sim_factory(config, info), memory_probe or (lambda: None)
    objective = Objective(
        config=config,
        space=space,
        workload=workload,
        engine_factory=engine_factory or factory_for(config, path),
        logs_dir=logs_dir,
        model=info,
        memory_probe=memory_probe or (lambda: DeviceMemory.probe(config.device)),
        records=records,
        served_factory=served_factory if config.serves_after else None,
        gpu_name=engine_factory().device_name if simulated else gpu_name(config.device),
    )
    choice = None
    if pilot_first:
        from optimizer.search.pilot import run_pilot

        # before the study exists: every one of its trials replays the count the pilot chooses
        with Ticker("pilot: vLLM's defaults measure the TTFT tail", say, live=live) as ticker:
            config, choice = run_pilot(config, storage, objective, records, ticker.write)
        objective = replace(objective, config=config, workload=build_workload(config.workload, info.vocab_size))
    study = open_study(config, storage, joined=slot)
    if new_study:
        for key, value in fitted.items():
            study.set_user_attr(key, value)
    else:
        warning = machine_warning(STUDY_MACHINE.of(study), config.device)
        if warning:
            say(warning)
    if choice is not None:
        STUDY_REQUESTS_CHOICE.set(study, choice.to_dict())
    if config.prescreen and not slot and (config.budget is None or finished_count(study) < config.budget):
        with Ticker(f"pre-screen: {config.prescreen} simulated trials", say, live=live) as ticker:
            from optimizer.search.prescreen import prescreen_study

            prescreen_study(config, study, storage, objective, studies_dir, ticker.write)
    say(f"study {config.study_name!r}: {config.limits.text}, budget {budget_text(config)}, "
        f"engine logs in {objective.logs_dir}")
    return Prepared(config, study, objective)


def budget_text(config: StudyConfig) -> str:
    """'40 trials', 'until 17:05 (8h)', or '40 trials or until 17:05 (8h), whichever comes first'."""
    parts = [f"{config.budget} trials"] if config.budget is not None else []
    if config.deadline_unix_s is not None:
        import time

        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(config.deadline_unix_s))
        given = f" ({clock_text(config.time_budget_s)})" if config.time_budget_s else ""
        parts.append(f"until {when}{given}")
    return " or ".join(parts) + (", whichever comes first" if len(parts) > 1 else "")


def fit_to_machine(config: StudyConfig, info: ModelInfo, engine_factory: EngineFactory | None, logs_dir: Path,
                   say: Callable[..., None], live: bool | None = None) -> tuple[StudyConfig, dict[str, Any]]:
    """A new study fitted to this machine (optimizer/search/fitting.py): the dtype it serves, the embedded demo's scale
    (a probe), and what to store with it: the machine's fingerprint, the time it was made and the probe's result."""
    machine = fingerprint(config.device)
    say(f"machine: {describe(machine)}")
    config, line = served_dtype(config, info.dtype)
    say(line)
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    fitted: dict[str, Any] = {**STUDY_MACHINE.item(machine), **STUDY_CREATED.item(created)}
    if config.demo_probe:
        factory = engine_factory or factory_for(config, model_path(config))
        with Ticker("probe: measuring this machine", say, live=live) as ticker:
            config, scale = size_demo(config, info, factory, logs_dir, ticker.write)
        if scale is not None:
            fitted.update(STUDY_DEMO_SCALE.item(scale))
    return config, fitted


def say_to_stderr(*args: Any) -> None:
    import sys

    print(*args, file=sys.stderr)


def run(prepared: Prepared, quiet: bool = False, say: Callable[..., None] = say_to_stderr,
        slots: Callable[[], Sequence[Slot]] | None = None, cluster: Cluster | None = None, gpus_at_once: int = 1
        ) -> optuna.Study:
    """Run search trials until the study holds its budget of them (less the confirmation's runs), or the next would
    end past its deadline (less the time kept for the confirmation); then the confirmation (search/confirm.py).

    Unless `quiet`, one progress display covers both (search/progress.py): it prints every trial's and run's line,
    and the lines said meanwhile, under one estimate of the time left, which the run's first line states.

    `slots` (--gpus, search/slots.py) starts the processes that run the search trials at once; this process then
    says their trials as they finish and runs the confirmation once they have all stopped. `cluster` (--ray,
    search/raycluster.py) runs the search trials as tasks on a Ray cluster, and the confirmation as one; the time left
    counts the trials that run at once on `gpus_at_once` GPUs."""
    from optimizer.search import confirm
    from optimizer.search.confirmed import confirmation
    from optimizer.search.split import CONFIGS, plan

    config, study = prepared.config, prepared.study
    serves = prepared.objective.served_factory is not None
    split = plan(config.budget, config.confirm, serves)
    say(split.line)
    estimate = trial_estimate(prepared)
    tally = Tally(split.search_budget, split.runs)
    tally.resume(study)

    def reserve_s() -> float:
        run_s = confirm.run_estimate_s(study)
        return split.runs * run_s if run_s is not None else 0.0

    def status() -> Status:  # a search trial's length over how many run at once
        trial_s, at_once = estimate(), trials_at_once(study, gpus_at_once, config.engine_args)
        return run_status(prepared, tally, lambda: trial_s and trial_s / at_once)

    first = status()
    if not quiet:
        say(start_estimate(first, tally))
    progress = None if quiet else Progress(first)
    say = progress.write if progress is not None else say

    def on_trial(s: optuna.Study, trial: FrozenTrial) -> None:
        if progress is not None:  # a run of an interrupted confirmation, still queued, may come first
            progress.write(confirm.describe(trial) if is_confirmation(trial) else describe_trial(trial))
            progress.update(status())

    def on_run(s: optuna.Study, trial: FrozenTrial) -> None:
        tally.run_done(study)
        if progress is not None:
            progress.write(confirm.describe(trial))
            progress.update(status())

    try:
        if slots is not None:
            from optimizer.search.slots import watch

            stop = watch(study, slots(), on_trial)
        elif cluster is not None:
            stop = cluster.search(on_trial, split.search_budget, config.deadline_unix_s, estimate, reserve_s)
        else:
            stop = run_to_budget(study, prepared.objective, split.search_budget, on_trial=on_trial,
                                 deadline_unix_s=config.deadline_unix_s, trial_estimate_s=estimate,
                                 reserve_s=reserve_s, wait_running_s=config.trial_timeout_s)
        if stop.reason:
            say(stop.reason)
        rounds = 0
        if split.rounds and not stop.reason.startswith("time budget: the deadline has passed"):
            current = confirmation(study)  # a resumed plan (of this search: its key): its rounds take no more time
            done = len(current.full_rounds) if current is not None and current.plan.get("plan") == \
                confirm.plan_key(study) else 0
            rounds = confirm.rounds_in_time(split.rounds, config.deadline_unix_s, confirm.run_estimate_s(study),
                                            done=done)
            if rounds < split.rounds:
                say(f"confirmation: {rounds} of {split.rounds} rounds fit before the deadline")
        tally.confirm(rounds * CONFIGS + (split.served if rounds else 0))
        if progress is not None:
            progress.update(status())
        if rounds:
            line = (cluster.confirm if cluster is not None else confirm.run)(
                study, prepared.objective, rounds, config.engine_args, say, on_run=on_run,
                deadline_unix_s=config.deadline_unix_s, workload_seed=config.workload.seed, served=serves,
                asked=config.confirm is not None)
            if line:
                say(line)
        tally.confirmed()
        if progress is not None:
            progress.update(status())
    except Exception as exc:
        from optimizer.search.dbretry import storage_error_in

        lost = storage_error_in(exc)  # the database went away: say so in one line, not as Optuna's UnboundLocalError
        if lost is not None and lost is not exc:
            raise lost from None
        raise
    finally:
        if progress is not None:
            progress.close()
    return study


def run_status(prepared: Prepared, tally: Tally, estimate: Callable[[], float | None] | None = None) -> Status:
    """Where the run of `prepared` stands now: search trials at `trial_estimate`'s length, confirmation runs at the
    median run's (search/confirm.py `run_estimate_s`), and before any trial both at the probe's estimate, so that
    the first estimate is the probe's for the whole study."""
    from optimizer.search.confirm import run_estimate_s

    estimate = estimate or trial_estimate(prepared)
    trial_s = estimate()
    return tally.status(prepared.study, trial_s, run_estimate_s(prepared.study) or trial_s,
                        prepared.config.deadline_unix_s)


def start_estimate(status: Status, tally: Tally) -> str:
    """The run's one estimate of its length, as its progress display starts it."""
    left = status.left_s(status.at_s)
    what = (f"{tally.search_budget} search trials" if tally.search_budget is not None else "search trials") + (
        f" and {tally.runs_planned} confirmation runs" if tally.runs_planned else "")
    if left is None:
        return f"estimated time: known after the first trial ({what})"
    until = " (the deadline)" if status.work_s is None or status.work_s > left else ""
    return f"estimated time: ~{clock_text(left)}{until} for {what}"


def trial_estimate(prepared: Prepared) -> Callable[[], float | None]:
    """How long the next trial will take: the median of this study's measured trials (the probe's estimate before
    any), None when nothing is known yet."""
    return lambda: stored_trial_s(prepared.study, prepared.config.budget)


def stored_trial_s(study: optuna.Study, budget: int | None) -> float | None:
    """A trial's length as `study` knows it: the median of its measured trials, else its probe's estimate spread over
    its `budget`; None when it knows neither."""
    import statistics

    done = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if TIMINGS.of(t).get("total_s")]
    if done:
        return float(statistics.median(TIMINGS.of(t)["total_s"] for t in done))
    scale = STUDY_DEMO_SCALE.of(study)
    if scale:
        return float(scale["scale"]["estimated_s"]) / max(budget or 40, 1)
    return None


def p99_advice(prepared: Prepared, tolerance: float = 0.4) -> str | None:
    """How well the recommendation's replay pinned down TTFT P99, and the replay length that would (stored too).

    Only for a recommendation measured by fixed-length replays, each judged on its own P99. A trial measured by
    probes sized by evidence has its rate at the limit from a fit over every request it sent, with its interval on
    its progress line and in the confirmation's table: one probe's P99 and a replay length are not what its number
    rests on, and advice to lengthen replays would send the user after the wrong knob (None).

    The count is advice for the next study, not changed in this one: every trial of a study replays the same
    requests, so that their results compare (`--num-requests auto` chooses it before a study starts).
    """
    from optimizer.search.confirmed import recommended
    from optimizer.measurement.stability import p99_stability

    best = recommended(prepared.study)
    store = prepared.objective.records
    m = measurement_of(best) if best is not None else None
    if m is None or store is None or m.rate_at_limit is not None:
        return None
    rate = m.rate_rps
    target = math.inf if rate is None else float(rate)
    replays = [recs for r, recs in store.load(prepared.config.study_name, best.number) if math.isclose(r, target)]
    ttft = [1000 * r.ttft_s for r in (replays[-1] if replays else []) if r.ok and r.ttft_s is not None]
    if len(ttft) < 10:
        return None
    s = p99_stability(ttft, tolerance)
    STUDY_P99_STABILITY.set(prepared.study, {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                                             for k, v in s.__dict__.items()})
    return s.advice_text(tolerance)
