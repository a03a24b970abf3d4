"""`optimize --dry-run`: what the run would do, in a dozen lines, without starting an engine or writing anything.

The settings are resolved as the run resolves them (cli/run.py `resolve_config`, the same checks, the same one-line
errors), then described: the vLLM build and the device, the model and its size, the workload, the limits, the search
space, the budget's split between the search and the confirmation, and the estimated time. The estimate is the one
the run would start from: a resumed study's measured trials; the embedded demo's, which the probe at its start fits
to this machine; the GPU demo's from vLLM's start-up phases; for any other model, none before an engine has started.
"""

from __future__ import annotations

from dataclasses import replace

import tempfile
import textwrap
from pathlib import Path
from typing import Any

from optimizer.config.settings import Choice, FloatRange, IntRange, StudyConfig

WIDTH = 100
LABEL = 10  # the labels' column: "workload: " and the like


def dry_run(config: StudyConfig, resumed: bool, ray: str | None = None) -> int:
    """Print the plan of the run of `config` (resolved as the run resolves it: cli/run.py `resolve_config`; a resumed
    study's when `resumed`; `ray`: --ray's address) and return 0; a --confirm the budget cannot hold fails as the run
    would (exit code 2)."""
    from optimizer.search.split import plan

    split = plan(config.budget, config.confirm, config.serves_after)
    print("\n".join(plan_lines(config, resumed, split.line, ray)))
    return 0


def field(label: str, text: str, width: int = WIDTH) -> list[str]:
    """'label:   text', wrapped to `width` under the text's column; a word longer than a line (a path, a URL) stays
    whole on a line of its own, so it can be copied."""
    return textwrap.wrap(text, width, initial_indent=f"{label}:".ljust(LABEL), subsequent_indent=" " * LABEL,
                         break_on_hyphens=False, break_long_words=False) or [f"{label}:"]


def plan_lines(config: StudyConfig, resumed: bool, split_line: str, ray: str | None = None) -> list[str]:
    """The dry run's lines for `config` (a resumed study's when `resumed`; on the Ray cluster at `ray`)."""
    from optimizer.hardware.device import installed_build
    from optimizer.hardware.machine import describe, fingerprint
    from optimizer.params.space import resolve
    from optimizer.search.progress import clock_text
    from optimizer.search.runner import budget_text
    from optimizer.search.study import redact  # a password in the URL is never printed

    info, model = model_text(config)
    space = resolve(config.space, config.device, info.max_len, config.workload, info.mla, config.engine_args)
    workload = config.workload.describe()
    if config.num_requests_auto and not resumed:
        workload = workload.replace(f"{config.workload.num_requests} requests per replay",
                                    "requests per replay chosen by a pilot trial")
    study = f"{config.study_name!r}, " + ("resumed" if resumed else "new") + f", in {redact(config.storage_url)}"
    engine = f"{installed_build().describe()}; the trials run on {config.device}" if config.engine == "vllm" else \
        f"none: the simulated engine serves the trials (a step-time model of vLLM on {config.device})"
    gpus = []
    if config.gpus:
        from optimizer.hardware.gpu_pool import pool_for

        pool = pool_for(config.gpus, config.engine == "sim", Path(tempfile.gettempdir()))  # reads, locks nothing
        gpus = field("GPUs", f"{pool.describe()}: up to {pool.size} trials at once, each on its layout's GPUs")
    if ray:
        gpus = field("cluster", f"the Ray cluster at {ray} (a dry run does not join it): each trial a task on one "
                     f"node with its layout's GPUs, as many at once as the cluster's GPUs hold")
    return [
        "dry run: what the run would do; no engine starts, nothing is written",
        *field("vLLM", engine),
        *gpus,
        *field("machine", describe(fingerprint(config.device))),
        *field("study", study),
        *field("model", model),
        *field("workload", workload),
        *field("limits", f"{config.limits.text}; a trial stops after {clock_text(config.trial_timeout_s)}"),
        *field("space", space_text(space.dists, space.fixed, config.engine_args)),
        *field("budget", f"{budget_text(config)}; {split_line}"),
        *field("time", estimate_text(config, resumed)),
    ]


def model_text(config: StudyConfig) -> tuple[Any, str]:
    """(ModelInfo, its line): name or path, parameters, weights' size. The embedded CPU demo is described from its
    shape, without generating it."""
    from optimizer.config.model import is_demo_model, model_info
    from optimizer.config.model import demo_shape
    from optimizer.engines.vllm_config import rank_model
    from optimizer.search.runner import engine_base_args, model_path, read_model

    if config.model_is_default and is_demo_model(config.model):
        shape = demo_shape(config.model)
        info = model_info(shape.config, config.model, shape.weights_bytes)
        where = f"embedded {config.model} (a Llama, random weights)"
    else:
        path = model_path(config)
        info = read_model(config, path, config.engine == "vllm")
        if not info.weights_bytes and config.engine == "vllm":  # random weights: what vLLM's own build holds
            rank = rank_model(engine_base_args(config, path), config.deploy_as, {})
            info = replace(info, weights_bytes=rank.weights_bytes) if rank is not None else info
        where = (f"embedded {config.model}" if config.model_is_default else config.model) + \
            (" with random weights (load_format=dummy)" if config.dummy_weights else "")
    params = info.weights_bytes / max(info.dtype_bytes, 1)
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
    weights = f"{info.weights_bytes / 2**30:.1f} GiB" if info.weights_bytes >= 2**30 else \
        f"{info.weights_bytes / 2**20:.0f} MiB"
    if not info.weights_bytes:  # vLLM could not build it without weights: its own start will say more
        return info, f"{where}: as {info.dtype}, its weights counted by vLLM at each trial"
    probe = "; the probe at the start (an engine start, about a minute) may choose a smaller one" \
        if config.model_is_default and config.demo_probe else ""
    return info, f"{where}: {size} parameters, {weights} of weights as {info.dtype}{probe}"


def space_text(dists: dict[str, Any], fixed: dict[str, Any], engine_args: dict[str, Any]) -> str:
    """'max_num_seqs 2-256 (log), block_size {32, 64, 128}, ...; fixed: max_model_len=1024, enforce_eager=True'."""
    def one(name: str, d: Any) -> str:
        if isinstance(d, IntRange):
            return f"{name} {d.low}-{d.high}" + (" (log)" if d.log else f" step {d.step}" if d.step != 1 else "")
        if isinstance(d, FloatRange):
            return f"{name} {d.low:g}-{d.high:g}" + (f" step {d.step:g}" if d.step else "")
        assert isinstance(d, Choice)
        return f"{name} {{{', '.join(str(c) for c in d.choices)}}}"

    held = {**engine_args, **fixed}
    text = ", ".join(one(k, d) for k, d in dists.items())
    return text + ("; fixed: " + ", ".join(f"{k}={v}" for k, v in held.items()) if held else "")


def estimate_text(config: StudyConfig, resumed: bool) -> str:
    """The run's estimate of its length, made without starting an engine, and what it rests on."""
    from optimizer.search.probe import TARGET_S_PER_TRIAL
    from optimizer.search.progress import clock_text

    deadline = f"; at most {config_deadline(config)}" if config.deadline_unix_s is not None else ""
    if config.engine == "sim":
        return "seconds a trial: the simulated engine serves each replay in virtual time" + deadline
    if resumed:  # the run's own first estimate (search/runner.py `start_estimate`), from its measured trials
        import optuna

        from optimizer.search.confirm import run_estimate_s
        from optimizer.search.progress import Tally
        from optimizer.search.runner import start_estimate, stored_trial_s
        from optimizer.search.split import plan
        from optimizer.search.study import finished_count, storage_for

        study = optuna.load_study(study_name=config.study_name, storage=storage_for(config.storage_url))
        split = plan(config.budget, config.confirm, config.serves_after)
        tally = Tally(split.search_budget, split.runs)
        tally.resume(study)
        trial_s = stored_trial_s(study, config.budget)
        status = tally.status(study, trial_s, run_estimate_s(study) or trial_s, config.deadline_unix_s)
        done = f"{finished_count(study)} search trials finished"
        if status.work_s == 0:  # the budget is spent: the run would only print the result again
            return f"none: nothing is left to run ({done}); a larger --budget adds trials"
        return f"{start_estimate(status, tally).removeprefix('estimated time: ')}; {done}"
    if config.demo_probe and config.budget is not None:
        return (f"~{clock_text(config.budget * TARGET_S_PER_TRIAL)} at most: the probe at the start fits the demo to "
                f"this machine at {TARGET_S_PER_TRIAL:.0f} s a trial, and prints its own estimate{deadline}")
    gpu = gpu_demo_estimate(config)
    if gpu is not None:
        return gpu + deadline
    return ("known after the first trial: it rests on an engine start, which a dry run does not make; the run "
            f"prints it then{deadline}")


def gpu_demo_estimate(config: StudyConfig) -> str | None:
    """The GPU demo's estimate from vLLM's start-up phases (search/gpu_demo.py), where `config` runs it."""
    from optimizer.config.model import GPU_DEMO_NAME

    if not (config.model_is_default and config.model == GPU_DEMO_NAME and config.device == "cuda"):
        return None
    from optimizer.search.gpu_demo import estimate_text as gpu_estimate

    return gpu_estimate(config)


def config_deadline(config: StudyConfig) -> str:
    from optimizer.search.runner import budget_text

    return budget_text(config.model_copy(update={"budget": None}))
