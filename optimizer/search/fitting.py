"""Fit a new study to the machine it is created on: the dtype its trials serve, the embedded demo's scale, and
the machine's fingerprint stored with it. A resume keeps all three, and warns when it runs on another machine."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from optimizer.config.model import DEMO_LADDER, ModelInfo
from optimizer.config.settings import StudyConfig
from optimizer.core.units import format_ms
from optimizer.hardware.machine import DtypeChoice, choose_dtype, cpu_info, describe, differences, fingerprint
from optimizer.measurement.engine import EngineFactory
from optimizer.search.recovery import end_recorded, record_engine


def dtype_fixed_by_user(config: StudyConfig) -> str | None:
    """Where the user fixed or searches the dtype ('--space' or engine arguments), if anywhere."""
    if "dtype" in config.space.fixed or "dtype" in config.space.ranges:
        return "--space"
    if "dtype" in config.engine_args:
        return "the study's engine arguments"
    return None


def served_dtype(config: StudyConfig, model_dtype: str) -> tuple[StudyConfig, str]:
    """The study with the dtype its trials serve fixed in its engine arguments (when it must differ from the
    model's own), and a line that says which and why. A dtype the user fixed or searches wins."""
    where = dtype_fixed_by_user(config)
    if where is not None:
        value = config.space.fixed.get("dtype", config.engine_args.get("dtype"))
        shown = value if value is not None else f"searched over {config.space.ranges['dtype']}"
        return config, f"dtype: {shown} (given in {where})"
    choice: DtypeChoice = choose_dtype(model_dtype, config.device, cpu_info())
    if choice.dtype is None:
        return config, f"dtype: {model_dtype}: {choice.reason}"
    config = config.model_copy(update={"engine_args": {**config.engine_args, "dtype": choice.dtype}})
    return config, f"dtype: {choice.dtype}: {choice.reason}"


def cpu_engine_args(model_dtype: str = "bfloat16") -> dict[str, Any]:
    """Engine arguments for a vLLM CPU engine outside a study (calibration, tests, benchmarks): eager, and the
    dtype chosen as a study chooses it."""
    choice = choose_dtype(model_dtype, "cpu", cpu_info())
    return {"enforce_eager": True, **({"dtype": choice.dtype} if choice.dtype else {})}


def size_demo(config: StudyConfig, info: ModelInfo, factory: EngineFactory, logs_dir: Path,
              say: Callable[..., None]) -> tuple[StudyConfig, dict[str, Any] | None]:
    """Probe this machine on the largest embedded shape and choose the demo's model (optimizer/search/probe.py).

    Returns the study with its model chosen, and what to store with it. A probe that cannot run keeps the
    largest shape and says why.
    """
    from optimizer.core.clock import MonotonicClock
    from optimizer.core.errors import OptimizerError
    from optimizer.search.objective import CPU_BASELINE_MEMORY_FALLBACK
    from optimizer.search.probe import TARGET_S_PER_TRIAL, choose_scale, probe

    dtype = config.engine_args.get("dtype") or config.space.fixed.get("dtype") or info.dtype
    params = {k: v for k, v in config.space.fixed.items() if k != "max_model_len"}
    params.setdefault("gpu_memory_utilization", CPU_BASELINE_MEMORY_FALLBACK)  # as the baseline starts on CPU
    say(f"probe: vLLM's defaults on {DEMO_LADDER[0].name} in {dtype}, to size the demo to this machine")
    log_path = logs_dir / "probe.log"
    record = logs_dir / PROBE_ENGINE_RECORD
    ended = end_recorded(record)  # an earlier run killed while it probed left its engine running
    if ended:
        say(f"probe: ended the engine processes an interrupted probe left running (PIDs {', '.join(map(str, ended))})")
    try:
        result = asyncio.run(recorded(probe, factory, record, config.workload, info.vocab_size, MonotonicClock(),
                                      DEMO_LADDER[0].name, str(dtype), params, log_path))
    except OptimizerError as exc:
        say(f"probe failed ({str(exc)[:200]}; see {log_path}): keeping {DEMO_LADDER[0].name}")
        return config, None
    finally:
        record.unlink(missing_ok=True)
    from optimizer.search.split import plan

    budget = config.budget or 40
    runs = plan(config.budget, config.confirm, config.serves_after).runs if config.budget is not None else 0
    ttft = next((lim for lim in config.limits if lim.metric == "ttft"), None)  # the prefill is fitted to it
    ttft_ms = ttft.value_ms if ttft is not None else math.inf
    scale = choose_scale(result, ttft_ms, budget, config.workload.num_requests, confirm_runs=runs,
                         warmup_load_requests=config.workload.warmup_load_requests)
    say(f"probe: lone {result.prompt_tokens}-token prefill {format_ms(result.prefill_ms)}, "
        f"{result.decode_ms:.1f} ms per output token, burst ceiling {result.burst_rps:.1f} req/s, engine start "
        f"{result.start_s:.0f} s")
    verdict = ("no TTFT limit: the largest shape estimated within the budget" if ttft is None else
               f"its lone prefill (predicted {format_ms(scale.predicted_prefill_ms)}) is the largest within 20% of "
               f"the {ttft.text} limit" if scale.fits else
               f"even its lone prefill (predicted {format_ms(scale.predicted_prefill_ms)}) is past 20% of the "
               f"{ttft.text} limit: few configs may meet it; a larger {ttft.flag.split()[0]} gives a clearer study")
    if config.budget is None and config.deadline_unix_s is not None:
        import time

        per_trial_s = scale.estimated_s / budget
        fit = max(int((config.deadline_unix_s - time.time()) / per_trial_s), 0)
        verdict += f"; estimated ~{per_trial_s:.0f} s per trial: about {fit} trials before the deadline"
    # the run's estimated time is printed once, as its progress display starts (search/runner.py `start_estimate`)
    update: dict[str, Any] = {"model": scale.model}
    if scale.num_requests and scale.num_requests < config.workload.num_requests:
        verdict += (f"; {scale.num_requests} requests per replay instead of {config.workload.num_requests}, to end "
                    f"in time (even the smallest shape is estimated past {TARGET_S_PER_TRIAL:.0f} s per trial)")
        update["workload"] = config.workload.model_copy(update={"num_requests": scale.num_requests})
    say(f"demo scale: {scale.model}: {verdict}")
    config = config.model_copy(update=update)
    return config, {"probe": result.to_dict(), "scale": scale.to_dict()}


PROBE_ENGINE_RECORD = "probe.engine.json"  # the probe's engine processes while it runs (search/recovery.py)


async def recorded(measure: Callable[..., Any], factory: EngineFactory, record: Path, *args: Any) -> Any:
    """`measure(factory', *args)` with every engine `factory'` makes kept on record in `record` while it runs (looked
    at each second), so that a run killed meanwhile leaves its engine's PIDs for the next run to end."""
    made: list[Any] = []

    def tracked() -> Any:
        made.append(factory())
        return made[-1]

    task = asyncio.ensure_future(measure(tracked, *args))
    kept: list[Any] = []
    while not task.done():
        await asyncio.wait({task}, timeout=1.0)
        refs = [r for e in made for r in getattr(e, "process_refs", [])]
        if refs and refs != kept:  # written when the engine's processes change, not every second
            record_engine(record, refs)
            kept = refs
    return task.result()


def machine_warning(stored: dict[str, Any] | None, device: str) -> str | None:
    """A line when this resume runs on another machine than the study was created on (None when the same)."""
    if not stored:
        return None
    diffs = differences(stored, fingerprint(device))
    if not diffs:
        return None
    return (f"warning: this study was created on another machine ({describe(stored)}); here: {'; '.join(diffs)}. "
            f"Its new trials would mix measurements of both machines: start a new --study to compare like with "
            f"like")
