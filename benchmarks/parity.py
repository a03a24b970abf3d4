"""Do this project's numbers agree with `vllm bench serve`? Same server, same config, same requests, same arrivals.

One vLLM OpenAI-compatible server is started (embedded default model, a fixed config). Against it, alternating,
run (a) this project's replay through the HTTP engine in measure-only mode and (b) vLLM's own benchmark client
(`vllm.benchmarks.serve`, what `vllm bench serve` runs) with `--dataset-name timed_trace`: a JSONL written from the
project's workload, so both sides send requests of identical prompt and output lengths at identical offsets
(self-timed), with token-id prompts and ignore_eos. The prefix cache is reset before every run. Then the same
config runs in process (VllmEngine) for the in-process vs HTTP comparison. Prints medians, spreads and the ratios
ours/vLLM (targets: output throughput within 5%, TTFT P50 and P99 within 10%).

    flock /tmp/optimizer-engine.lock .venv/bin/python benchmarks/parity.py [--repeats 3] [--rates 4,inf]
        [--model tiny-llama-7m] [--max-num-seqs 0]   (0: vLLM's default, as the demo's baseline)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.config.model import DEFAULT_MODEL_NAME, default_model, inspect_model
from optimizer.config.workload_spec import CPU_DEMO_WORKLOAD, WorkloadSpec
from optimizer.core.clock import MonotonicClock
from optimizer.engines.http_engine import HttpEngine, RemoteEngine
from optimizer.engines.vllm_engine import VllmEngine
from optimizer.measurement.metrics import summarize
from optimizer.measurement.replay import replay
from optimizer.measurement.workload import Workload, build_workload
from optimizer.search.fitting import cpu_engine_args

METRICS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")
TARGETS = {"output_tok_s": 0.05, "ttft_p50_ms": 0.10, "ttft_p99_ms": 0.10}

# `vllm bench serve` without the `vllm` console script (the CPU build's script fails on a metadata look-up), with
# the same event-loop stall watch as our side (a stalled client loop delays reading the first chunk: TTFT grows).
VLLM_BENCH = """
import asyncio, sys, time
import vllm.benchmarks.serve as S
from vllm.utils.argparse_utils import FlexibleArgumentParser
STALL_S, stalls = %r, []
async def beat():
    while True:
        t0 = time.perf_counter(); await asyncio.sleep(0.005)
        lag = time.perf_counter() - t0 - 0.005
        if lag > STALL_S: stalls.append(lag)
run = S.benchmark
async def watched(*a, **k):
    task, cpu0 = asyncio.create_task(beat()), time.process_time()
    try:
        return await run(*a, **k)
    finally:
        task.cancel()
        cpu = time.process_time() - cpu0
        print(f"STALLS {len(stalls)} {1000 * max(stalls, default=0):.0f} {cpu:.2f}", file=sys.stderr)
S.benchmark = watched
p = FlexibleArgumentParser(); S.add_cli_args(p); S.main(p.parse_args(sys.argv[1:]))
"""
STALL_S = 0.05
VLLM_BENCH = VLLM_BENCH % STALL_S


class StallWatch:
    """Counts this process's event-loop stalls over STALL_S during a run (the same probe as in VLLM_BENCH)."""

    def __init__(self) -> None:
        self.stalls: list[float] = []

    async def _beat(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.005)
            lag = time.perf_counter() - t0 - 0.005
            if lag > STALL_S:
                self.stalls.append(lag)

    async def __aenter__(self) -> StallWatch:
        self._task = asyncio.create_task(self._beat())
        self._cpu0 = time.process_time()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        self.cpu_s = time.process_time() - self._cpu0

    def summary(self) -> dict[str, float]:
        return {"stalls": len(self.stalls), "max_stall_ms": 1000 * max(self.stalls, default=0.0),
                "client_cpu_s": self.cpu_s}


def timed_trace(workload: Workload, rate: float, path: Path) -> Path:
    """The workload as vLLM's timed_trace JSONL: same lengths, same send offsets; unique hash ids per 16-token
    chunk, so that no two prompts share a prefix (as in the project's random prompts)."""
    next_hash = 0
    with path.open("w") as f:
        for req, t in zip(workload.requests, workload.arrivals_s(rate)):
            chunks = math.ceil(req.input_len / 16)
            f.write(json.dumps({"timestamp": t, "input_length": req.input_len, "output_length": req.output_len,
                                "hash_ids": list(range(next_hash, next_hash + chunks))}) + "\n")
            next_hash += chunks
    return path


def _ours(records, rate: float) -> dict[str, float]:
    m = summarize(records, rate)
    assert m.failed == 0, [r.error for r in records if not r.ok][:3]
    return {"output_tok_s": m.output_throughput_tok_s, "ttft_p50_ms": m.ttft.p50_ms, "ttft_p99_ms": m.ttft.p99_ms,
            "tpot_p50_ms": m.tpot.p50_ms, "duration_s": m.duration_s, "completed": m.completed,
            "ttfts_ms": [r.ttft_s * 1000 for r in sorted(records, key=lambda r: r.index)]}


def vllm_bench(url: str, model: str, trace: Path, n: int, out: Path) -> dict[str, float]:
    cmd = [sys.executable, "-c", VLLM_BENCH, "--backend", "vllm", "--base-url", url, "--model", model,
           "--tokenizer", model, "--dataset-name", "timed_trace", "--dataset-path", str(trace),
           "--num-prompts", str(n), "--ignore-eos", "--seed", "0", "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"vllm bench serve failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    r = json.loads(out.read_text())
    stall = [ln.split() for ln in proc.stderr.splitlines() if ln.startswith("STALLS ")]
    assert r["completed"] == n and not r.get("failed"), r.get("errors", [])[:3]
    return {"output_tok_s": r["output_throughput"], "ttft_p50_ms": r["p50_ttft_ms"],
            "ttft_p99_ms": r["p99_ttft_ms"], "tpot_p50_ms": r["p50_tpot_ms"], "duration_s": r["duration"],
            "completed": r["completed"], "ttfts_ms": [t * 1000 for t in r.get("ttfts", [])],
            "stalls": int(stall[-1][1]) if stall else -1, "max_stall_ms": float(stall[-1][2]) if stall else -1.0,
            "client_cpu_s": float(stall[-1][3]) if stall else -1.0}


async def http_side(model: str, params: dict[str, Any], workload: Workload, rates: list[float], repeats: int,
                    work: Path, log: Path) -> dict[tuple[str, float], list[dict[str, float]]]:
    """Ours (measure-only) and vLLM's client on one server, alternating which goes first in each repeat."""
    runs: dict[tuple[str, float], list[dict[str, float]]] = {}
    server = HttpEngine({"model": model, **cpu_engine_args()})
    await server.start(params, log)
    remote = RemoteEngine(server.base_url)
    try:
        await remote.start({})
        clock = MonotonicClock()
        await replay(remote, workload.warmup, [0.0] * len(workload.warmup), clock)
        traces = {rate: timed_trace(workload, rate, work / f"trace-{rate:g}.jsonl") for rate in rates}
        for i in range(repeats):
            for rate in rates:
                order = ("ours", "vllm") if i % 2 == 0 else ("vllm", "ours")
                for side in order:
                    await remote.reset_prefix_cache()
                    if side == "ours":
                        async with StallWatch() as watch:
                            records = await replay(remote, workload.requests, workload.arrivals_s(rate), clock)
                        got = {**_ours(records, rate), **watch.summary()}
                    else:
                        got = await asyncio.to_thread(vllm_bench, server.base_url, remote.model_name, traces[rate],
                                                      len(workload.requests), work / f"vllm-{rate:g}-{i}.json")
                    runs.setdefault((side, rate), []).append(got)
                    print(f"  repeat {i + 1} rate {rate:g} {side:>5}: " + ", ".join(
                        f"{k} {got[k]:.1f}" for k in (*METRICS, "stalls", "client_cpu_s")), flush=True)
    finally:
        await remote.shutdown()
        await server.shutdown()
    return runs


async def inprocess_side(model: str, params: dict[str, Any], workload: Workload, rates: list[float], repeats: int,
                         log: Path) -> dict[tuple[str, float], list[dict[str, float]]]:
    runs: dict[tuple[str, float], list[dict[str, float]]] = {}
    engine = VllmEngine({"model": model, **cpu_engine_args()})
    await engine.start(params, log)
    try:
        clock = MonotonicClock()
        await replay(engine, workload.warmup, [0.0] * len(workload.warmup), clock)
        for i in range(repeats):
            for rate in rates:
                await engine.reset_prefix_cache()
                async with StallWatch() as watch:
                    records = await replay(engine, workload.requests, workload.arrivals_s(rate), clock)
                got = {**_ours(records, rate), **watch.summary()}
                runs.setdefault(("inproc", rate), []).append(got)
                print(f"  repeat {i + 1} rate {rate:g} inproc: " + ", ".join(
                    f"{k} {got[k]:.1f}" for k in (*METRICS, "stalls", "client_cpu_s")), flush=True)
    finally:
        await engine.shutdown()
    return runs


def _med(runs: list[dict[str, float]], key: str) -> tuple[float, float, float]:
    v = np.asarray([r[key] for r in runs], dtype=float)
    return float(np.median(v)), float(v.min()), float(v.max())


def table(runs: dict[tuple[str, float], list[dict[str, float]]], rates: list[float]) -> str:
    lines = [f"{'rate':>5} {'metric':>13} | {'ours (HTTP) median [min-max]':>30} | {'vLLM bench median [min-max]':>30}"
             f" | {'ours/vLLM':>9} {'target':>7} | {'in-process median [min-max]':>30} | {'inproc/HTTP':>11}"]
    for rate in rates:
        for key in METRICS:
            cells, med = [], {}
            for side in ("ours", "vllm", "inproc"):
                if (side, rate) not in runs:
                    cells.append(f"{'-':>30}")
                    continue
                m, lo, hi = _med(runs[(side, rate)], key)
                med[side] = m
                cells.append(f"{m:>12.1f} [{lo:>7.1f}-{hi:>7.1f}]")
            ratio = med["ours"] / med["vllm"] if med.get("vllm") else math.nan
            tol = TARGETS.get(key)
            verdict = "-" if tol is None else ("ok" if abs(ratio - 1) <= tol else "MISS")
            target = f"±{tol:.0%} {verdict}" if tol else "-"
            inproc = med["inproc"] / med["ours"] if "inproc" in med and med.get("ours") else math.nan
            lines.append(f"{rate:>5g} {key:>13} | {cells[0]} | {cells[1]} | {ratio:>9.3f} {target:>7} | {cells[2]} | "
                         f"{inproc:>11.3f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rates", default="4,inf", help="offered rates, req/s (inf: all at once)")
    p.add_argument("--num-requests", type=int, default=CPU_DEMO_WORKLOAD["num_requests"])
    p.add_argument("--max-num-seqs", type=int, default=16, help="0: vLLM's default (the demo's baseline)")
    p.add_argument("--model", default=DEFAULT_MODEL_NAME, help="an embedded demo model (tiny-llama-17m, -7m, -4m)")
    p.add_argument("--skip-inprocess", action="store_true")
    p.add_argument("--out", default=None, help="folder for traces, vLLM's result JSONs, logs (default: a temp dir)")
    args = p.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    model = str(default_model(args.model))
    spec = WorkloadSpec(**{**CPU_DEMO_WORKLOAD, "num_requests": args.num_requests})
    workload = build_workload(spec, inspect_model(model).vocab_size)
    params = {**({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}), "gpu_memory_utilization": 0.2}
    work = Path(args.out or tempfile.mkdtemp(prefix="parity-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"model {model}; config {params}; workload {spec.num_requests} requests, inputs {spec.input_len_min}-"
          f"{spec.input_len_max}, outputs {spec.output_len_min}-{spec.output_len_max} tokens; rates {args.rates}; "
          f"{args.repeats} alternating repeats; files in {work}", flush=True)
    runs = asyncio.run(http_side(model, params, workload, rates, args.repeats, work, work / "server.log"))
    if not args.skip_inprocess:
        runs.update(asyncio.run(inprocess_side(model, params, workload, rates, args.repeats, work / "inproc.log")))
    (work / "runs.json").write_text(json.dumps({f"{s} {r:g}": v for (s, r), v in runs.items()}, indent=1))
    print(table(runs, rates))
    print("client per run: event-loop stalls > 50 ms / longest stall ms / client CPU s during the run")
    for (side, rate), v in sorted(runs.items()):
        print(f"  {side:>6} {rate:>4g}: " + "; ".join(
            f"{r['stalls']:.0f} / {r['max_stall_ms']:.0f} / {r['client_cpu_s']:.1f}" for r in v))


if __name__ == "__main__":
    main()
