"""`optimize report`: the Pareto front, the recommendation against vLLM's defaults, a trial's curve, plots,
and a re-ranking of the stored replays for another limit.

Same edge rules as the main command: flags -> typed values -> library -> print; bad input is a UsageError
(exit code 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from optimizer.cli.common import add_common_flags, add_format_flag, add_limit_flags, guarded, limits_given, load_study
from optimizer.cli.manual import new_parser
from optimizer.core.errors import UsageError
from optimizer.search.attrs import CONFIRM, PRUNED_DETAIL, PRUNED_REASON
from optimizer.search.study import run_name


def build_parser() -> argparse.ArgumentParser:
    """The parser of `optimize report`, with its help page (cli/manual.py)."""
    p = new_parser(
        "optimize report",
        "Print the feasible Pareto front of a study (output throughput vs TTFT P99), the recommendation against "
        "vLLM's defaults and the parameter importances; write STUDY.report.png and a self-contained "
        "STUDY.report.html. With limits (--ttft-p99, --tpot-p99, --itl-p99, --e2e-p99, --slo, --goodput) the stored "
        "replays are re-ranked for them, in place of the study's own, without rerunning anything.",
        [("optimize report --study llama", "the front and the recommendation; writes the PNG and HTML"),
         ("optimize report --study llama --ttft-p99 300ms --format csv", "re-ranked for a 300 ms limit, as CSV"),
         ("optimize report --study llama --trial 3", "trial #3's replays: its latency-vs-load curve"),
         ("optimize report --study llama --trial c2", "confirmation run c2: its round, the config it measured again"),
         ("optimize report --study llama --bench-json best.json", "the recommendation as `vllm bench serve` JSON")])
    add_common_flags(p)
    add_format_flag(p)
    p.add_argument("--out", help="folder for the PNG and HTML report (default: the studies dir)")
    add_limit_flags(p, rerank=True)  # given: they replace the study's own limits (every one to hold is given)
    p.add_argument("--trial", help="print this trial's parameters and replays (its latency-vs-load curve) instead of "
                   "the front; a confirmation run's name (c2, as its console line gives it) prints that run: its "
                   "round, the config it measured, its probes")
    p.add_argument("--bench-json", metavar="PATH", help="write the result of --trial (default: the recommended trial) "
                   "in the JSON format of `vllm bench serve --save-result`")
    return p


def cmd_report(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    return guarded(ns.debug, lambda: _report(ns), "report")


def _report(ns: argparse.Namespace) -> int:
    from optimizer.core.paths import check_output_dir, check_output_file
    from optimizer.decision.decide import decide, run_views, view
    from optimizer.decision.document import render
    from optimizer.decision.tables import check_format, curve_table, drop_empty_columns, format_output
    from optimizer.decision.views import confirmation_run_lines, curve_rows, trial_heading, trial_notes

    check_format(ns.format)
    if ns.out is not None:
        check_output_dir(ns.out, "--out", "a folder for the PNG and HTML report")
    if ns.bench_json:
        check_output_file(ns.bench_json, "--bench-json", "result.json")
    limits = limits_given(ns)  # None: the study's own
    trial_no = None if ns.trial is None else trial_name(ns.trial)
    config, study = load_study(ns)
    records = None
    if limits is not None and limits.key != config.limits.key:  # other limits: judged again from the stored requests
        from optimizer.cli.common import storage_url
        from optimizer.search.records import RecordStore

        records = RecordStore.existing(storage_url(ns))  # the database as opened here, not as stored with the study
    try:
        decision = decide(study, config, limits, records)
    finally:
        if records is not None:
            records.close()
    say = (lambda *a: None) if ns.quiet else (lambda *a: print(*a, file=sys.stderr))
    if trial_no is not None or ns.bench_json:
        if trial_no is None and decision.best is None:
            raise UsageError("no trial meets the limit, so there is no recommendation to write: pass --trial N")
        runs = run_views(study, decision) if trial_no is not None else {}
        chosen = runs[trial_no] if trial_no in runs else view(decision, trial_no, list(runs)) \
            if trial_no is not None else decision.best
        run = CONFIRM.of(chosen.trial)  # a confirmation run: `of` is the search trial it measured again
        of = view(decision, int(run["of"])) if run is not None else None
        what = f"run {run_name(chosen.trial)}" if run is not None else f"trial #{chosen.number}"
        if trial_no is not None:
            heading = trial_heading(decision, chosen, of)
            rows = curve_rows(decision, chosen)
            why = PRUNED_REASON.of(chosen.trial) or "no curve stored"
            for line in heading:
                (print if ns.format == "table" else say)(line)
            print(format_output(drop_empty_columns(curve_table(rows, decision.limits)) if ns.format == "table" else rows, ns.format)
                  if rows or ns.format != "table" else
                  f"{what} stored no replays: it could not run ({why}: {PRUNED_DETAIL.of(chosen.trial)})")
            notes = trial_notes(chosen) + ([] if of is not None else confirmation_run_lines(decision, chosen))
            if rows and ns.format == "table":
                notes.append("(every column of its replays: --format csv or --format json)")
            for line in notes:
                (print if ns.format == "table" else say)(line)
        if ns.bench_json:
            from optimizer.decision.benchjson import bench_result, chosen_point, confirmed_metadata, write_bench_json

            point = chosen_point(chosen.trial, decision.limits)
            result = bench_result(chosen.trial, config, point, decision.limits)
            meta = confirmed_metadata(decision, of if of is not None else chosen)  # a run: its config's numbers
            if run is not None:
                meta["optimizer_confirmation_run"] = {"of": run["of"], "round": int(run["round"]) + 1,
                                                      "run": run_name(chosen.trial)}
            path = write_bench_json(Path(ns.bench_json), {**result, **meta})
            rate = point.get("offered_rate_rps")
            say(f"wrote {path} ({what} at {'a burst' if rate is None else f'{rate:.2f} req/s'})")
        return 0
    from optimizer.decision.html import run_info
    from optimizer.decision.plots import write_report

    from optimizer.decision.report import lead_lines

    out, extra = render(decision, ns.format, lead_lines(decision, config))
    print(out)
    for line in extra:
        say(line)
    png, html = write_report(decision, Path(ns.out or ns.studies_dir), run_info(study, config))
    say(f"wrote {png} and {html}")
    return 0


def trial_name(text: str) -> str:
    """`--trial`'s value as the report looks it up: a trial's number ('3', '#3' -> '3') or a confirmation run's
    name ('c2', 'C02' -> 'c2'), else a UsageError that shows both forms."""
    name = text.strip().lstrip("#").lower()
    if name.isdigit():
        return str(int(name))
    if name[:1] == "c" and name[1:].isdigit():
        return f"c{int(name[1:])}"
    raise UsageError(f"--trial {text!r} is not a trial number, nor a confirmation run's name: e.g. --trial 3, or "
                     f"--trial c2 (the name a confirmation run's line gives)")
