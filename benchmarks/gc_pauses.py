"""This process's own garbage collections during a replay, with the heap frozen (optimizer/measurement/quiet_heap.py)
and without (before it): their pauses and the TTFT P99 they leave in the measurement.

    flock /tmp/optimizer-engine.lock .venv/bin/python benchmarks/gc_pauses.py --studies-dir studies --study default
        [--backend inprocess|http] [--pairs 4] [--num-requests 500] [--rate R]

One engine (vLLM's defaults of the study, in process or `vllm serve` read by this project's HTTP client), warmed,
then `--pairs` pairs of replays of the study's workload (one draw per pair, shared by both arms) at `--rate`
(default: the defaults' rate at the limit in the study), the arms alternating in order (AB, BA, ...), the prefix
cache reset before each. Printed per replay: the arm, TTFT P99, the collections that ran (of them full ones) and the
longest pause; then the medians per arm. The process holds what `optimize` holds (vLLM, torch, Optuna and the
study loaded), so a full collection walks as much as it does there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optimizer.measurement.replay as replay_module  # noqa: E402
from optimizer.config.model import inspect_model  # noqa: E402
from optimizer.core.clock import MonotonicClock  # noqa: E402
from optimizer.engines.http_engine import HttpEngine  # noqa: E402
from optimizer.engines.vllm_engine import VllmEngine  # noqa: E402
from optimizer.measurement.metrics import summarize  # noqa: E402
from optimizer.measurement.quiet_heap import GcPauses, frozen_heap  # noqa: E402
from optimizer.measurement.workload import build_workload  # noqa: E402
from optimizer.search.attrs import ENGINE_PARAMS  # noqa: E402
from optimizer.search.runner import engine_base_args, model_path  # noqa: E402
from held import decided  # noqa: E402 (benchmarks/held.py)

ARMS = {"frozen": frozen_heap, "as before": contextlib.nullcontext}


async def measure(client, workloads: list, rate: float) -> list[tuple[str, float, int, int, float]]:
    """(arm, TTFT P99 ms, collections, full ones, longest pause ms) per replay, on `client`, started."""
    rows = []
    clock = MonotonicClock()
    w0 = workloads[0]
    await replay_module.replay(client, w0.warmup, [0.0] * len(w0.warmup), clock)
    for k, w in enumerate(workloads):
        for arm in (list(ARMS) if k % 2 == 0 else list(ARMS)[::-1]):
            await client.reset_prefix_cache()
            replay_module.frozen_heap = ARMS[arm]  # the replay as it ran before quiet_heap.py, or as it runs now
            try:
                with GcPauses() as pauses:
                    records = await replay_module.replay(client, w.requests, w.arrivals_s(rate), clock)
            finally:
                replay_module.frozen_heap = frozen_heap
            m = summarize(records, rate)
            full = sum(g == 2 for g, _ in pauses.pauses)
            rows.append((arm, m.ttft.p99_ms, len(pauses.pauses), full, pauses.max_ms))
            print(f"  pair {k}: {arm:<9} TTFT P99 {m.ttft.p99_ms:6.1f} ms; {len(pauses.pauses)} collections "
                  f"({full} full), longest {pauses.max_ms:.1f} ms", flush=True)
    return rows


async def in_process(base: dict, deploy_as: str, params: dict, workloads: list, rate: float, log: Path) -> list:
    engine = VllmEngine(base, deploy_as=deploy_as)
    await engine.start(params, log)
    try:
        return await measure(engine, workloads, rate)
    finally:
        await engine.shutdown()


async def as_served(base: dict, params: dict, workloads: list, rate: float, log: Path) -> list:
    server = HttpEngine(base)  # its own client is this project's, the one `--backend http` measures with
    await server.start(params, log)
    try:
        return await measure(server, workloads, rate)
    finally:
        await server.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--studies-dir", default="studies")
    p.add_argument("--study", default="default")
    p.add_argument("--backend", choices=("inprocess", "http"), default="inprocess")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--rate", type=float, default=None)
    args = p.parse_args()
    config, d = decided(Path(args.studies_dir), args.study)
    if d.baseline is None:
        raise SystemExit("the study has no baseline (vLLM's defaults) to replay")
    params = ENGINE_PARAMS.of(d.baseline.trial)
    rate = args.rate or d.baseline.ranked.rate_rps
    path = model_path(config)
    vocab = inspect_model(path, config.dummy_weights).vocab_size
    workloads = [build_workload(config.workload.model_copy(update={"num_requests": args.num_requests,
                                                                   "seed": config.workload.seed + 200 + k}), vocab)
                 for k in range(args.pairs)]
    base = engine_base_args(config, path)
    log = Path(args.studies_dir) / f"gc-pauses-{args.backend}.log"
    rows = asyncio.run(as_served(base, params, workloads, rate, log) if args.backend == "http" else
                       in_process(base, config.deploy_as, params, workloads, rate, log))
    print(f"\n{args.backend}, vLLM's defaults at {rate:.2f} req/s, {args.pairs} pairs of {args.num_requests} requests, "
          f"TTFT P99 limit {config.ttft_p99_ms:.0f} ms")
    for arm in ARMS:
        mine = [r for r in rows if r[0] == arm]
        print(f"  {arm:<9}: TTFT P99 median {statistics.median(r[1] for r in mine):.1f} ms "
              f"({', '.join(f'{r[1]:.0f}' for r in mine)}); full collections {sum(r[3] for r in mine)}; "
              f"longest pause {max(r[4] for r in mine):.1f} ms")


if __name__ == "__main__":
    main()
