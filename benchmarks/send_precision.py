"""Load generator precision: send-time error (actual - planned) of the replay at 50 and 200 requests/s.

Against a fast engine (the fake, ~0.5 ms per step), so that the engine is never what delays a send.
Target on a 2-core machine: P99 under 3 ms (the clock does not spin: optimizer/core/clock.py).

    .venv/bin/python benchmarks/send_precision.py [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import numpy as np

from optimizer.config.workload_spec import WorkloadSpec
from optimizer.core.clock import MonotonicClock
from optimizer.measurement.replay import replay
from optimizer.measurement.workload import build_workload

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.fake_engine import FakeEngine  # noqa: E402


async def measure(rate_rps: float, requests: int) -> np.ndarray:
    spec = WorkloadSpec(num_requests=requests, warmup_requests=0, input_len_min=8, input_len_max=16,
                        output_len_min=1, output_len_max=2, seed=1)
    workload = build_workload(spec, 1000)
    engine = FakeEngine(step_s=0.0005, per_seq_s=0.0, prefill_s_per_token=0.0)
    await engine.start({"max_num_seqs": 1024})
    try:
        records = await replay(engine, workload.requests, workload.arrivals_s(rate_rps), MonotonicClock())
    finally:
        await engine.shutdown()
    return np.asarray([(r.sent_s - r.planned_s) * 1000 for r in records])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    args = p.parse_args()
    print(f"{'rate req/s':>10}  {'requests':>8}  {'P50 ms':>7}  {'P99 ms':>7}  {'max ms':>7}  target P99 < 3 ms")
    for rate in (50.0, 200.0):
        err_ms = asyncio.run(measure(rate, args.requests))
        p50, p99 = np.percentile(err_ms, 50), np.percentile(err_ms, 99)
        verdict = "ok" if p99 < 3.0 else "MISSED"
        print(f"{rate:>10.0f}  {len(err_ms):>8d}  {p50:>7.3f}  {p99:>7.3f}  {err_ms.max():>7.3f}  {verdict}")


if __name__ == "__main__":
    main()
