"""The same replay, again and again on one engine: how far one engine's speed moves over its life and the minutes, and
whether a probe of the machine between replays sees it.

    flock /tmp/optimizer-engine.lock .venv/bin/python benchmarks/engine_life.py --studies-dir DIR --study NAME
        --rate 66 [--replays 12] [--engines 2] [--extra-warmup 0] [--pairs 0] [--seed 3004]

vLLM's defaults of a finished study (its stored engine arguments and workload), one draw (workload seed `--seed`) at
one rate. Each engine gets a trial's warm-up and warm-up under load, then `--replays` full replays back to back, each
cold (prefix cache reset). Per replay: requests over the limit, TTFT P50/P99, TPOT P50, and before it (1.5 s after the
last, when vLLM's engine core and worker have stopped spinning on their queues) three probes of the machine, each in
a thread bound to one CPU, best of 3: a fixed pure-Python loop on each CPU (the engine's scheduler and this client are
Python), and copies of 4 MiB (cache) and 256 MiB (memory) on the worker's CPU 0. A replay that is the same requests
at the same times on an engine that runs the same code reads alike unless the engine or the machine moved.

`--extra-warmup N` gives each engine N more whole replays at the rate before the first measured one: whether the
engine's first minutes under load are what its later replays outrun.

`--pairs N` instead keeps two engines alive at once and replays on them in turn: an engine slower than its partner
throughout is the engine's start; both moving together is the machine's minute. (On the 2-core Xeon both read as
slow as the slowest engine alone or slower: the idle one's processes may cost the other.)
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from optimizer.config.model import inspect_model  # noqa: E402
from optimizer.core.clock import MonotonicClock  # noqa: E402
from optimizer.engines.vllm_engine import VllmEngine  # noqa: E402
from optimizer.measurement.evidence import count  # noqa: E402
from optimizer.measurement.metrics import summarize  # noqa: E402
from optimizer.measurement.replay import replay  # noqa: E402
from optimizer.measurement.workload import build_workload  # noqa: E402
from optimizer.search.attrs import ENGINE_PARAMS  # noqa: E402
from optimizer.search.runner import engine_base_args, model_path  # noqa: E402

from held import decided, warm_up_under_load  # noqa: E402

SETTLE_S = 1.5  # vLLM's shm queues spin for a second after their last read


def on_cpu(cpu: int, work: Callable[[], None], tries: int = 3) -> float:
    """Milliseconds `work` takes in a thread bound to `cpu`, best of `tries`."""
    out: list[float] = []

    def run() -> None:
        os.sched_setaffinity(0, {cpu})  # this thread only
        for _ in range(tries):
            t = time.perf_counter()
            work()
            out.append((time.perf_counter() - t) * 1000)
    th = threading.Thread(target=run)
    th.start()
    th.join()
    return min(out)


def python_loop(loops: int = 200_000) -> None:
    x = 0
    for i in range(loops):
        x += i * i % 7


def copier(mib: int) -> Callable[[], None]:
    src = np.ones(mib * 1024 * 1024 // 8)
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)


def probes(cache: Callable[[], None], memory: Callable[[], None]) -> str:
    return (f"probes: Python {on_cpu(0, python_loop):.1f} / {on_cpu(1, python_loop):.1f} ms (CPU 0 / 1), copy 4 MiB "
            f"{on_cpu(0, cache):.2f} ms, 256 MiB {on_cpu(0, memory):.1f} ms")


async def measured(engine, workload, rate: float, limit_ms: float, clock) -> str:
    await engine.reset_prefix_cache()
    records = await replay(engine, workload.requests, workload.arrivals_s(rate), clock)
    c = count(sorted(records, key=lambda r: (r.sent_s, r.index)), math.inf, limit_ms)
    m = summarize(records, rate)
    return (f"{c.over:4d} of {c.resolved} over; TTFT P50 {m.ttft.p50_ms:5.1f} P99 {m.ttft.p99_ms:6.1f} ms; "
            f"TPOT P50 {m.tpot.p50_ms:5.2f} ms")


async def one_engine(base, deploy_as, params, workload, rate, replays, limit_ms, warm, log, extra: int = 0) -> None:
    engine = VllmEngine(base, deploy_as=deploy_as)
    cache, memory = copier(4), copier(256)
    await engine.start(params, log)
    started = time.perf_counter()
    clock = MonotonicClock()
    try:
        await replay(engine, workload.warmup, [0.0] * len(workload.warmup), clock)
        await warm_up_under_load(engine, workload, rate, warm, clock)
        for _ in range(extra):  # more load before the first measured replay: whole replays, measured nowhere
            await engine.reset_prefix_cache()
            await replay(engine, workload.requests, workload.arrivals_s(rate), clock)
        for k in range(replays):
            await asyncio.sleep(SETTLE_S)
            seen = probes(cache, memory)
            at = time.perf_counter() - started
            print(f"  replay {k:2d} at {at:5.0f} s: {await measured(engine, workload, rate, limit_ms, clock)}; "
                  f"{seen}", flush=True)
    finally:
        await engine.shutdown()


async def two_engines(base, deploy_as, params, workload, rate, replays, limit_ms, warm, logs) -> None:
    engines = [VllmEngine(base, deploy_as=deploy_as) for _ in logs]
    clock = MonotonicClock()
    try:
        for engine, log in zip(engines, logs):
            await engine.start(params, log)
        for engine in engines:
            await replay(engine, workload.warmup, [0.0] * len(workload.warmup), clock)
            await warm_up_under_load(engine, workload, rate, warm, clock)
        for k in range(replays):
            for name, engine in zip("AB", engines):
                print(f"  engine {name} replay {k}: {await measured(engine, workload, rate, limit_ms, clock)}",
                      flush=True)
    finally:
        for engine in engines:
            await engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--studies-dir", default="studies")
    p.add_argument("--study", default="default")
    p.add_argument("--rate", type=float, required=True, help="req/s, the same for every replay")
    p.add_argument("--replays", type=int, default=12, help="per engine")
    p.add_argument("--engines", type=int, default=2, help="engines one after another")
    p.add_argument("--pairs", type=int, default=0, help="instead: pairs of engines alive at once, in turn")
    p.add_argument("--seed", type=int, default=3004, help="the draw's workload seed")
    p.add_argument("--extra-warmup", type=int, default=0, metavar="N",
                   help="N whole replays at the rate after the trial's warm-up, measured nowhere")
    p.add_argument("--out", default="/tmp", help="folder for the engines' logs")
    args = p.parse_args()
    config, d = decided(Path(args.studies_dir), args.study)
    if d.confirmation is None or d.confirmation.base is None:
        raise SystemExit("the study has no confirmation with vLLM's defaults: run optimize to its end first")
    path = model_path(config)
    base = engine_base_args(config, path)
    params = ENGINE_PARAMS.of(d.confirmation.base.trial)
    workload = build_workload(config.workload.model_copy(update={"seed": args.seed}),
                              inspect_model(path, config.dummy_weights).vocab_size)
    warm = min(config.workload.warmup_load_requests, config.workload.num_requests)
    out = Path(args.out)
    for e in range(args.pairs):
        print(f"pair {e}: vLLM's defaults, draw {args.seed}, {args.rate:.2f} req/s, two engines in turn", flush=True)
        asyncio.run(two_engines(base, config.deploy_as, params, workload, args.rate, args.replays, config.ttft_p99_ms,
                                warm, [out / f"engine-life-pair{e}-{x}.log" for x in "ab"]))
    for e in range(0 if args.pairs else args.engines):
        print(f"engine {e}: vLLM's defaults, draw {args.seed}, {args.rate:.2f} req/s"
              f"{f', after {args.extra_warmup} more replays' if args.extra_warmup else ''}", flush=True)
        asyncio.run(one_engine(base, config.deploy_as, params, workload, args.rate, args.replays, config.ttft_p99_ms,
                               warm, out / f"engine-life-{e}.log", args.extra_warmup))


if __name__ == "__main__":
    main()
