"""The real engine: a confirmation run's rate at the limit against full replays of its own draw on the same engine,
minutes apart, for several draws (benchmarks/same_draw.py asks the same of the simulator).

    flock /tmp/optimizer-engine.lock .venv/bin/python benchmarks/same_draw_real.py --studies-dir DIR --study NAME
        [--draws 1,2,3,4,5]

vLLM's defaults of a finished study. Per draw (workload seed: the study's + 3000 + the draw's number, never a draw the
study measured), one fresh engine: a run as the confirmation measures it (the warm-up, the warm-up under load, probes
sized by evidence from the rounds' median rate, bisected to within 3%, the pooled fit: search/probes.py); then full
replays of all of the draw's requests (no stop rule) at 0.9x to 1.1x that run's rate, in the order 1.0, 0.9, 1.1,
0.95, 1.05 and back, each with its count over the limit by fifths of the replay; then the run again. Printed per draw:
both runs' probes and rates, and the fit over the full replays (the counts' own, no re-measurement term); then
log(run / full replays) per draw, the runs taken as their geometric mean, and the second run against the first.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimizer.config.model import inspect_model  # noqa: E402
from optimizer.core.clock import MonotonicClock  # noqa: E402
from optimizer.engines.vllm_engine import VllmEngine  # noqa: E402
from optimizer.measurement.evidence import count  # noqa: E402
from optimizer.measurement.rate_fit import ProbeCount, fit_rate_at_limit  # noqa: E402
from optimizer.measurement.replay import replay  # noqa: E402
from optimizer.measurement.workload import build_workload  # noqa: E402
from optimizer.search.attrs import ENGINE_PARAMS  # noqa: E402
from optimizer.search.confirm import prior_spec  # noqa: E402
from optimizer.search.probes import TrialReplays  # noqa: E402
from optimizer.search.runner import engine_base_args, model_path  # noqa: E402

from held import decided  # noqa: E402

FACTORS = (1.0, 0.9, 1.1, 0.95, 1.05)
DRAWS_FROM = 3000


def probes_text(result) -> str:
    return "; ".join(f"{q.offered_rate_rps:.2f} {q.over_limit}/{q.requests}" for q in result.points if q.requests)


async def one_draw(base, deploy_as, params, config, workload, prior_rps: float, log: Path):
    """(first run, second run, the fit over the full replays) on one fresh engine; None where one found no rate."""
    engine = VllmEngine(base, deploy_as=deploy_as)
    await engine.start(params, log)
    clock = MonotonicClock()
    limit = config.ttft_p99_ms
    try:
        first = await TrialReplays(engine, workload, config, clock, None, 0, []).measure(
            None, confirm=prior_spec([prior_rps]))
        if first.fit is None:
            print(f"    run: {probes_text(first)} -> no rate at the limit: no full replays", flush=True)
            return None
        print(f"    run: {probes_text(first)} -> {first.fit.rate_rps:.2f} req/s", flush=True)
        rate, counts = first.fit.rate_rps, []
        for f in FACTORS + FACTORS[::-1]:
            await engine.reset_prefix_cache()
            sent = sorted(await replay(engine, workload.requests, workload.arrivals_s(rate * f), clock),
                          key=lambda r: (r.sent_s, r.index))
            c = count(sent, math.inf, limit)
            counts.append(ProbeCount(rate * f, c.resolved, c.over, c.independent_fraction))
            fifths = [count(sent[i * len(sent) // 5:(i + 1) * len(sent) // 5], math.inf, limit).over for i in range(5)]
            print(f"    full replay {rate * f:6.2f} req/s ({f:.2f}x): {c.over:4d} of {c.resolved} over; by fifths "
                  f"{fifths}", flush=True)
        second = await TrialReplays(engine, workload, config, clock, None, 0, []).measure(
            None, confirm=prior_spec([prior_rps]))
        again = f"{second.fit.rate_rps:.2f} req/s" if second.fit is not None else "no rate at the limit"
        print(f"    run again: {probes_text(second)} -> {again}", flush=True)
    finally:
        await engine.shutdown()
    full = fit_rate_at_limit(counts, resamples=0, remeasure_cv=0.0)
    return None if second.fit is None or full is None else (first.fit, second.fit, full)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--studies-dir", default="studies")
    p.add_argument("--study", default="default")
    p.add_argument("--draws", default="1,2,3,4,5")
    p.add_argument("--out", default="/tmp", help="folder for the engines' logs")
    args = p.parse_args()
    config, d = decided(Path(args.studies_dir), args.study)
    c = d.confirmation
    if c is None or c.base is None or c.rate_interval(c.base).median is None:
        raise SystemExit("the study has no confirmation with vLLM's defaults at a rate: run optimize to its end first")
    prior = c.rate_interval(c.base).median
    path = model_path(config)
    base = engine_base_args(config, path)
    vocab = inspect_model(path, config.dummy_weights).vocab_size
    rows = []
    for k in (int(x) for x in args.draws.split(",")):
        workload = build_workload(config.workload.model_copy(update={"seed": config.workload.seed + DRAWS_FROM + k}),
                                  vocab)
        print(f"draw {k}: vLLM's defaults, from the rounds' {prior:.2f} req/s", flush=True)
        found = asyncio.run(one_draw(base, config.deploy_as, ENGINE_PARAMS.of(c.base.trial), config, workload,
                                     prior, Path(args.out) / f"same-draw-{k}.log"))
        if found is None:
            print(f"  draw {k}: a run or the full replays found no rate at the limit; left out", flush=True)
            continue
        a, b, full = found
        print(f"  run {a.rate_rps:.2f} [{a.low_rps:.2f}, {a.high_rps:.2f}], again {b.rate_rps:.2f} [{b.low_rps:.2f}, "
              f"{b.high_rps:.2f}]; the full replays' fit {full.rate_rps:.2f} [{full.low_rps:.2f}, {full.high_rps:.2f}]",
              flush=True)
        rows.append((a.rate_rps, b.rate_rps, full.rate_rps))
    if not rows:
        raise SystemExit("no draw gave a rate at the limit")
    gaps = [math.log(math.sqrt(a * b) / f) for a, b, f in rows]
    again = [math.log(b / a) for a, b, _ in rows]
    print(f"log(run / full replays), the two runs' geometric mean: {', '.join(f'{x:+.1%}' for x in gaps)}; mean "
          f"{statistics.mean(gaps):+.2%}\nlog(run again / run): {', '.join(f'{x:+.1%}' for x in again)}")


if __name__ == "__main__":
    main()
