"""How far one replay's speed moves a rate at the limit, on the simulator: the elasticity behind the rate fit's speed
model (optimizer/measurement/rate_fit.py: `profile`'s speed_cv per probe, `widened`'s re-measurement per run), which
treats a replay that runs slower by a factor f as one at f x its rate.

    .venv/bin/python benchmarks/speed_elasticity.py [--factor 1.1]

vLLM's defaults on the CPU demo setup (TTFT P99 <= 150 ms), noise-free, with every per-step cost multiplied by
1/factor, 1 and factor (optimizer/engines/sim/noise.py::scaled): the rate at the limit from 4 whole replays of 1000
requests at 5 rates around it, pooled in one fit. Printed: the three rates and d log(rate) / d log(step time), which
is 1 where a slower step only scales the rate and above 1 where it also eats into the fixed limit.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rate_coverage import remeasure  # noqa: E402
from sample_efficiency import setup  # noqa: E402
from sim_noise import DEFAULTS  # noqa: E402

from optimizer.engines.sim.noise import scaled  # noqa: E402
from optimizer.engines.sim.steptime import StepTimeModel  # noqa: E402
from optimizer.engines.simulated import SimulatedEngine  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--factor", type=float, default=1.1)
    args = p.parse_args(argv)
    bench = setup(150.0, 1)
    params = {**bench.config.engine_args, **DEFAULTS}

    async def rate(factor: float, around: float) -> float:
        engine = SimulatedEngine(bench.info, scaled(StepTimeModel(), factor), "cpu")
        await engine.start(params)
        fit = await remeasure(engine, bench, 0, around)
        await engine.shutdown()
        return fit.rate_rps

    middle = asyncio.run(rate(1.0, 50.0))
    middle = asyncio.run(rate(1.0, middle))
    fast, slow = (asyncio.run(rate(f, middle / f)) for f in (1 / args.factor, args.factor))
    elasticity = -math.log(slow / fast) / (2 * math.log(args.factor))
    print(f"step time x {1 / args.factor:.3f}: {fast:.2f} req/s; x 1: {middle:.2f}; x {args.factor}: {slow:.2f}; "
          f"elasticity of the rate at the limit to step time: {elasticity:.2f}")


if __name__ == "__main__":
    main()
