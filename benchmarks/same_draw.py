"""A trial against full replays of its own draw, on the simulator (no noise): how far the trial's rate at the limit
lies from the rate that whole replays of the same requests give, and whether placing each probe at its requests' own
scheduled rate would bring it closer.

    .venv/bin/python benchmarks/same_draw.py [--seeds 40] [--replay-cv 0.0]

For each workload seed s (vLLM's defaults on the CPU demo setup, TTFT P99 <= 150 ms, probes of at most 1000
requests): a trial as the study measures it (optimizer/search/probes.py), then whole replays of the same draw at
0.9x to 1.1x its rate, twice each, pooled in one fit ("same draw"). Beside the trial's own fit, the same probes fitted
at their scheduled rate: a probe stopped early sent only the first requests of the draw, whose arrival rate is not the
draw's (the unit arrivals are normalized over the whole draw, so only a full replay sends at exactly the offered
rate); "scheduled" places it at offered x (last request's index / its unit arrival). Printed per seed, then the mean
and root mean square of log(trial / same draw) and how often the trial's interval holds the same-draw rate.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sample_efficiency import setup  # noqa: E402
from sim_noise import DEFAULTS  # noqa: E402

from optimizer.core.clock import MonotonicClock  # noqa: E402
from optimizer.engines.sim.noise import NoiseSource, SimNoise  # noqa: E402
from optimizer.engines.sim.steptime import StepTimeModel  # noqa: E402
from optimizer.engines.simulated import SimulatedEngine  # noqa: E402
from optimizer.measurement.evidence import count  # noqa: E402
from optimizer.measurement.rate_fit import ProbeCount, fit_rate_at_limit  # noqa: E402
from optimizer.measurement.rate_search import probe_counts  # noqa: E402
from optimizer.measurement.replay import replay  # noqa: E402
from optimizer.measurement.workload import build_workload  # noqa: E402
from optimizer.search.probes import TrialReplays  # noqa: E402

RATES = (0.9, 0.95, 1.0, 1.05, 1.1)
REPEATS = 2


async def one(bench, noise: NoiseSource, seed: int):
    spec = bench.config.workload.model_copy(update={"seed": seed})
    workload = build_workload(spec, bench.info.vocab_size)
    engine = SimulatedEngine(bench.info, StepTimeModel(), "cpu", noise=noise)
    await engine.start({**bench.config.engine_args, **DEFAULTS})
    result = await TrialReplays(engine, workload, bench.config, MonotonicClock(), None, 0, []).measure(None)
    unit = [r.unit_arrival_s for r in workload.requests]
    counted = [p for p in result.points if p.requests and p.over_limit is not None
               and math.isfinite(p.offered_rate_rps)]
    scheduled = []
    for point, c in zip(counted, probe_counts(result.points)):
        last = point.completed + point.failed - 1  # its last request kept (approximate: rule.kept drops a few)
        factor = last / unit[last] if last > 0 and unit[last] > 0 else 1.0
        scheduled.append(dataclasses.replace(c, rate_rps=c.rate_rps * factor))
    probes = []
    for f in RATES:
        for _ in range(REPEATS):
            await engine.reset_prefix_cache()
            rate = result.fit.rate_rps * f
            records = await replay(engine, workload.requests, workload.arrivals_s(rate), MonotonicClock())
            c = count(sorted(records, key=lambda r: (r.sent_s, r.index)), math.inf, bench.config.ttft_p99_ms)
            probes.append(ProbeCount(rate, c.resolved, c.over, c.independent_fraction))
    await engine.shutdown()
    return result.fit, fit_rate_at_limit(scheduled), fit_rate_at_limit(probes, resamples=0, remeasure_cv=0.0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=40)
    p.add_argument("--replay-cv", type=float, default=0.0, help="per-replay log-normal sigma of the simulator's noise")
    args = p.parse_args(argv)
    bench = setup(150.0, 1)
    noise = NoiseSource(SimNoise(run_cv=0.0, replay_cv=args.replay_cv, drift_per_hour=0.0, seed=0))
    rows = []
    for seed in range(args.seeds):
        trial, scheduled, same = asyncio.run(one(bench, noise, seed))
        rows.append((trial, scheduled, same))
        print(f"seed {seed}: trial {trial.rate_rps:.2f} [{trial.low_rps:.2f}, {trial.high_rps:.2f}], scheduled "
              f"{scheduled.rate_rps:.2f}, same draw {same.rate_rps:.2f} req/s", flush=True)
    for k, name in ((0, "offered (the trial's fit)"), (1, "scheduled")):
        errors = [math.log(r[k].rate_rps / r[2].rate_rps) for r in rows]
        inside = sum(r[k].contains(r[2].rate_rps) for r in rows)
        print(f"{name}: mean {statistics.mean(errors):+.2%}, root mean square "
              f"{math.sqrt(statistics.mean(e * e for e in errors)):.2%} against the same draw; its interval holds "
              f"the same-draw rate {inside}/{len(rows)}")


if __name__ == "__main__":
    main()
