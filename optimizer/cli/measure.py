"""`optimize measure`: replay the study-style workload against a server that is already running (a deployment).

Nothing is started or restarted: the HTTP engine runs in measure-only mode (`RemoteEngine`). Same edge rules as
the main command: flags -> typed values -> library -> print; bad input is a UsageError (exit code 2).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from typing import Any

from optimizer.cli.common import add_format_flag, add_workload_flags, guarded, positive_int, workload_settings
from optimizer.cli.manual import new_parser
from optimizer.core.errors import UsageError


def build_parser() -> argparse.ArgumentParser:
    p = new_parser(
        "optimize measure",
        "Measure a running vLLM server (OpenAI-compatible API) with the same workload a study replays: Poisson "
        "arrivals at each --rate, token-id prompts, ignore_eos, streamed; TTFT, TPOT and throughput measured on "
        "this side, as clients see them. Nothing is restarted. The prefix cache is reset before each rate when the "
        "server allows it (started with VLLM_SERVER_DEV_MODE=1).",
        [("optimize measure --url http://127.0.0.1:8000 --rate 2,5,inf --num-requests 200",
          "three rates (inf: all requests at once), 200 requests each"),
         ("optimize measure --url http://127.0.0.1:8000 --rate 4 --preset chat --format json",
          "the chat workload at 4 req/s, as JSON")])
    p.add_argument("--url", required=True, help="base URL of the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--rate", action="append", required=True,
                   help="offered rate in requests/s, or inf for all at once; several as 2,5,inf or repeated")
    add_workload_flags(p, "measured requests per replay")
    p.add_argument("--vocab-size", type=str, help="vocabulary size of the served model, for the prompts' token ids "
                   "(default: read from the model's config.json when the server's model path is readable here)")
    p.add_argument("--wait", default="10s", help="how long to wait for /health (default: %(default)s)")
    add_format_flag(p)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--quiet", action="store_true", help="print only the result")
    return p


def parse_rates(values: list[str]) -> list[float]:
    """'2,5' and 'inf' -> [2.0, 5.0, inf]; anything else is a UsageError that shows the expected form."""
    rates: list[float] = []
    for value in values:
        for text in value.split(","):
            try:
                rate = float(text)
            except ValueError:
                rate = math.nan
            if math.isnan(rate) or rate <= 0:
                raise UsageError(f"--rate {text.strip()!r} is not a rate: give requests/s above 0 or inf, "
                                 f"e.g. --rate 5 or --rate 2,5,inf")
            rates.append(rate)
    return rates


def cmd_measure(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    return guarded(ns.debug, lambda: _measure(ns), "measure")


def _workload_fields(ns: argparse.Namespace) -> dict[str, Any]:
    """The workload flags, validated by the code that validates a study's (one place parses them)."""
    if (ns.num_requests or "").strip().lower() == "auto":
        raise UsageError("optimize measure replays the count it is given: pass a number, e.g. --num-requests 400 "
                         "('auto' is for studies, where a pilot trial chooses it)")
    workload, _ = workload_settings(ns)
    return workload


def _vocab_size(ns: argparse.Namespace, model_root: str) -> int:
    from pathlib import Path

    from optimizer.config.model import inspect_model

    if ns.vocab_size is not None:
        return int(positive_int(ns.vocab_size, "--vocab-size"))
    if (Path(model_root) / "config.json").is_file():
        return inspect_model(model_root).vocab_size
    raise UsageError(f"the server's model {model_root!r} is not readable here: pass --vocab-size N (the model's "
                     f"vocabulary size) so that prompts use valid token ids")


def _measure(ns: argparse.Namespace) -> int:
    from optimizer.decision.tables import check_format, format_output
    from optimizer.engines.http_engine import RemoteEngine, check_url
    from optimizer.core.units import parse_duration_ms

    check_format(ns.format)
    rates = parse_rates(ns.rate)
    fields = _workload_fields(ns)
    wait_s = parse_duration_ms(ns.wait, "--wait") / 1000
    try:
        url = check_url(ns.url)
    except UsageError as exc:
        raise UsageError(f"--url {exc}") from None
    engine = RemoteEngine(url, wait_s=wait_s)
    say = (lambda *a: None) if ns.quiet else (lambda *a: print(*a, file=sys.stderr))
    rows = asyncio.run(_run(engine, ns, fields, rates, say))
    print(format_output(rows, ns.format))
    return 0


async def _run(engine: Any, ns: argparse.Namespace, fields: dict[str, Any], rates: list[float],
               say: Any) -> list[dict[str, Any]]:
    from optimizer.core.clock import MonotonicClock
    from optimizer.config.workload_spec import CPU_DEMO_WORKLOAD, WorkloadSpec
    from optimizer.config.settings import build
    from optimizer.measurement.metrics import summarize
    from optimizer.config.model import is_demo_model
    from optimizer.measurement.replay import replay
    from optimizer.measurement.workload import build_workload

    try:
        await engine.start({})
    except UsageError as exc:  # the engine speaks of the URL; the user gave it as --url
        raise UsageError(f"{exc} (--url)") from None
    try:
        if is_demo_model(engine.model_root):  # the study's workload for a demo model, whichever shape was chosen
            try:
                from optimizer.config.presets import demo_workload

                fields = demo_workload(fields, CPU_DEMO_WORKLOAD)
            except ImportError:
                fields = {**CPU_DEMO_WORKLOAD, **fields}
        spec = build(WorkloadSpec, fields, "workload")
        if engine.max_model_len and spec.max_total_len > engine.max_model_len:
            raise UsageError(f"the workload's longest request ({spec.max_total_len} tokens) exceeds the server's "
                             f"max_model_len {engine.max_model_len}: lower --input-len/--output-len")
        workload = build_workload(spec, _vocab_size(ns, engine.model_root))
        say(f"server {engine.url}: model {engine.model_name}; {len(workload.requests)} requests per replay")
        clock = MonotonicClock()
        if workload.warmup:
            await replay(engine, workload.warmup, [0.0] * len(workload.warmup), clock)
        rows = []
        for rate in rates:
            await engine.reset_prefix_cache()
            records = await replay(engine, workload.requests, workload.arrivals_s(rate), clock)
            m = summarize(records, rate)
            rows.append({
                "rate_rps": rate, "sent_rps": m.sent_rate_rps, "achieved_rps": m.achieved_rate_rps,
                "completed": m.completed, "failed": m.failed, "duration_s": m.duration_s,
                "output_tok_s": m.output_throughput_tok_s, "ttft_p50_ms": m.ttft.p50_ms,
                "ttft_p99_ms": m.ttft.p99_ms, "tpot_p50_ms": m.tpot.p50_ms, "tpot_p99_ms": m.tpot.p99_ms,
                "itl_p99_ms": m.itl.p99_ms, "e2e_p99_ms": m.e2e.p99_ms,
            })
            say(f"rate {rate:g} req/s: TTFT P99 {m.ttft.p99_ms:.0f} ms, {m.output_throughput_tok_s:.0f} tok/s")
        if not engine.reset_supported:
            say("note: the server has no /reset_prefix_cache (start it with VLLM_SERVER_DEV_MODE=1 for cold "
                "replays); later rates may be served partly from cached prefixes")
        return rows
    finally:
        await engine.shutdown()
