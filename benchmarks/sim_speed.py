"""How fast the simulator runs: ten minutes of the CPU demo workload, simulated in virtual time.

    .venv/bin/python benchmarks/sim_speed.py [--minutes 10]

Prints, per arrival rate, the requests, engine steps, virtual seconds simulated and the CPU and wall seconds
it took (target: well under a second for a ten-minute workload).
"""

from __future__ import annotations

import argparse
import time

from optimizer.config.workload_spec import CPU_DEMO_WORKLOAD, WorkloadSpec
from optimizer.engines.sim.scheduler import SchedulerConfig
from optimizer.engines.sim.steptime import StepTimeModel
from optimizer.engines.sim.virtual import simulate
from optimizer.engines.simulated import VLLM_DEFAULTS
from optimizer.measurement.workload import build_workload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    args = p.parse_args()
    config = SchedulerConfig(**VLLM_DEFAULTS["cpu"], num_kv_blocks=5817)  # vLLM's CPU defaults at 0.3 memory
    print(f"{'rate req/s':>10}  {'requests':>8}  {'steps':>7}  {'virtual s':>9}  {'cpu s':>6}  {'wall s':>6}")
    for rate in (5.0, 10.0, 20.0):
        n = int(rate * args.minutes * 60)
        w = build_workload(WorkloadSpec(**{**CPU_DEMO_WORKLOAD, "num_requests": n}), 16000)
        arrivals = w.arrivals_s(rate)
        t_cpu, t_wall = time.process_time(), time.perf_counter()
        r = simulate(w.requests, arrivals, config, StepTimeModel())
        cpu, wall = time.process_time() - t_cpu, time.perf_counter() - t_wall
        print(f"{rate:>10.1f}  {n:>8}  {r.stats.steps:>7}  {r.duration_s:>9.1f}  {cpu:>6.2f}  {wall:>6.2f}")


if __name__ == "__main__":
    main()
