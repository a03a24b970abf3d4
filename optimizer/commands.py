"""The subcommands that read a finished study: `optimize export`, `optimize report`, `optimize verify`.

Same edge rules as cli.py: flags -> typed values -> library -> print; bad input is a UsageError (exit code 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from optimizer.cli import _common, _guarded, _load_study, _positive_int
from optimizer.errors import UsageError
from optimizer.units import parse_duration_ms


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


def _report(ns: argparse.Namespace) -> int:
    from optimizer.decision import FORMATS, curve_rows, decide, format_output, render, trial_notes, view

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
            for line in trial_notes(chosen):
                (print if ns.format == "table" else say)(line)
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
    from optimizer.runner import factory_for, model_path
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
    factory = factory_for(config, path)  # the backend the study measured with
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
