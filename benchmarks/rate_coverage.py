"""Does a trial's rate interval cover its rate at the limit re-measured on another draw? On the simulator, with the
shared-CPU noise injected.

    .venv/bin/python benchmarks/rate_coverage.py [--trials 20] [--run-cv 0.15] [--replay-cv 0.05]

Each of `--trials` times, for vLLM's defaults on the CPU demo setup (TTFT P99 <= 150 ms, probes of at most 1000
requests): a fresh engine measures the trial as the study does (optimizer/search/probes.py: first guess, probes
sized by evidence, the pooled fit), on workload seed s. Then the same rate is measured again on other draws: 4 whole
replays of the trial's length (1000 requests, seeds s + 10000 + d) at 5 rates around the trial's (0.9x to 1.1x),
every request pooled in the same fit (a rate at the limit depends on the replays' length, so the length is kept):

- on the same engine: what the trial's interval claims to cover (the sample of requests, not the machine);
- on a fresh engine: a new start's own speed too (the noise's `run_cv`), which no single trial can see.

Printed: the trials' rates, their intervals' half-widths (median and worst), the simulated minutes of replay per
trial, precision per minute (half-width x sqrt(minutes)), the share of re-measured rates inside the interval, and how
far the trial's rate lies from the same engine's re-measurement (root mean square, in log rate).

On the real engine, from studies already run (nothing is started):

    .venv/bin/python benchmarks/rate_coverage.py --real-study studies/default [--real-study DIR/NAME ...]

Each config of a study's confirmation was measured again in every round: on a fresh engine, on another draw, minutes
to a quarter of an hour after its search trial. Counted, per config and in total: the search trial's interval against
each round's rate at the limit; against the geometric mean of the rounds' rates (what the config gives on this machine
over the confirmation's minutes, its runs' own noise averaged); and each round's interval against the other rounds'
rates.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sample_efficiency import setup  # noqa: E402
from sim_noise import DEFAULTS  # noqa: E402

from optimizer.core.clock import MonotonicClock  # noqa: E402
from optimizer.engines.sim.noise import SHARED_CPU, NoiseSource, SimNoise  # noqa: E402
from optimizer.engines.simulated import SimulatedEngine  # noqa: E402
from optimizer.engines.sim.steptime import StepTimeModel  # noqa: E402
from optimizer.measurement.evidence import count  # noqa: E402
from optimizer.measurement.rate_fit import ProbeCount, RateAtLimit, fit_rate_at_limit  # noqa: E402
from optimizer.measurement.rate_search import probe_counts  # noqa: E402
from optimizer.measurement.replay import replay  # noqa: E402
from optimizer.measurement.workload import build_workload  # noqa: E402
from optimizer.search.probes import TrialReplays  # noqa: E402

REMEASURE_DRAWS = 4  # replays of the trial's own length (the workload's count) at each rate, each its own draw
REMEASURE_RATES = (0.9, 0.95, 1.0, 1.05, 1.1)


async def trial(engine: SimulatedEngine, bench, seed: int) -> tuple[RateAtLimit | None, float, RateAtLimit | None]:
    """One trial's rate at the limit on a workload of `seed`, the seconds its probes spent sending (what a real
    replay would take: each probe's requests at its rate), and the same probes fitted without a re-measurement's share
    (the counts' own interval: `remeasure_cv=0`)."""
    spec = bench.config.workload.model_copy(update={"seed": seed})
    workload = build_workload(spec, bench.info.vocab_size)
    result = await TrialReplays(engine, workload, bench.config, MonotonicClock(), None, 0, []).measure(None)
    before = fit_rate_at_limit(probe_counts(result.points), remeasure_cv=0.0)
    return result.fit, sum((pt.requests or 0) / pt.offered_rate_rps for pt in result.points), before


async def remeasure(engine: SimulatedEngine, bench, seed: int, around_rps: float) -> RateAtLimit | None:
    """The rate at the limit from REMEASURE_DRAWS whole replays of other draws (the trial's length: the rate at the
    limit of a replay depends on its length) at each of REMEASURE_RATES x `around_rps`, every request pooled."""
    limit, probes = bench.config.ttft_p99_ms, []
    for d in range(REMEASURE_DRAWS):
        spec = bench.config.workload.model_copy(update={"seed": seed + d})
        workload = build_workload(spec, bench.info.vocab_size)
        for f in REMEASURE_RATES:
            rate = around_rps * f
            await engine.reset_prefix_cache()
            records = await replay(engine, workload.requests, workload.arrivals_s(rate), MonotonicClock())
            c = count(sorted(records, key=lambda r: (r.sent_s, r.index)), float("inf"), limit)
            probes.append(ProbeCount(rate, c.resolved, c.over, c.independent_fraction))
    return fit_rate_at_limit(probes)


def real_coverage(paths: list[str]) -> None:
    """The per-trial intervals of stored real studies against their confirmations' re-measurements (see above)."""
    import optuna

    from fit_point import stored_study

    from optimizer.search.measured import measurement_of
    from optimizer.search.confirmed import confirmation

    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def fit(t) -> RateAtLimit | None:
        m = measurement_of(t)
        return None if m is None else m.fit

    totals = [0, 0, 0, 0, 0, 0]  # (inside, of) for: search vs runs, search vs the rounds' mean, run vs other runs
    print("| study | trial | search trial's interval | its rounds' rates (fresh engines, other draws) | inside | "
          "rounds' geometric mean | inside | each round's interval vs the other rounds |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in paths:
        where = Path(path)
        study = stored_study(where)
        c = confirmation(study)
        label = where.parent.parent.name if where.parent.name == "studies" else where.parent.name  # DIR/studies/NAME
        if c is None:
            print(f"| {path} | no confirmation | | | | | | |")
            continue
        for x in c.configs:
            searched = fit(x.trial)
            runs = [f for r in sorted(x.runs) if (f := fit(x.runs[r])) is not None]
            if searched is None or not math.isfinite(searched.high_rps) or len(runs) < 2:
                continue
            rates = [f.rate_rps for f in runs]
            mean = math.exp(statistics.mean(math.log(v) for v in rates))
            own = sum(searched.contains(v) for v in rates)
            pairs = [(a, b) for a in runs for b in runs if a is not b and math.isfinite(a.high_rps)]
            cross = sum(a.contains(b.rate_rps) for a, b in pairs)
            for k, v in enumerate((own, len(rates), int(searched.contains(mean)), 1, cross, len(pairs))):
                totals[k] += v
            print(f"| {label}/{where.name} | #{x.number} | {searched.rate_rps:.2f} "
                  f"[{searched.low_rps:.2f}, {searched.high_rps:.2f}] | {', '.join(f'{v:.2f}' for v in rates)} | "
                  f"{own}/{len(rates)} | {mean:.2f} | {'yes' if searched.contains(mean) else 'NO'} | "
                  f"{cross}/{len(pairs)} |")
    a, n, b, m, d, e = totals
    print(f"\nsearch trial's interval covers: a round's rate {a}/{n} ({a / max(n, 1):.0%}), the rounds' mean {b}/{m} "
          f"({b / max(m, 1):.0%}); a round's interval covers another round's rate {d}/{e} ({d / max(e, 1):.0%})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--run-cv", type=float, default=SHARED_CPU.run_cv, help="per-engine log-normal sigma")
    p.add_argument("--replay-cv", type=float, default=SHARED_CPU.replay_cv, help="per-replay log-normal sigma")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--real-study", action="append", help="DIR/NAME of a real study to read (repeatable); runs nothing")
    args = p.parse_args(argv)
    if args.real_study:
        real_coverage(args.real_study)
        return
    t0 = time.perf_counter()
    bench = setup(150.0, 1)
    noise = NoiseSource(SimNoise(run_cv=args.run_cv, replay_cv=args.replay_cv, drift_per_hour=0.0, seed=args.seed))
    params = {**bench.config.engine_args, **DEFAULTS}
    rows = []

    async def one(i: int) -> tuple:
        engine = SimulatedEngine(bench.info, StepTimeModel(), "cpu", noise=noise)
        await engine.start(params)
        fit, replay_s, before = await trial(engine, bench, seed=i)
        same = await remeasure(engine, bench, 10_000 + 10 * i, fit.rate_rps) if fit else None
        await engine.shutdown()
        fresh_engine = SimulatedEngine(bench.info, StepTimeModel(), "cpu", noise=noise)
        await fresh_engine.start(params)
        fresh = await remeasure(fresh_engine, bench, 20_000 + 10 * i, fit.rate_rps) if fit else None
        await fresh_engine.shutdown()
        return fit, replay_s, same, fresh, before

    for i in range(args.trials):
        rows.append(asyncio.run(one(i)))
    fits = [r for r in rows if r[0] is not None and r[0].half_width < float("inf")]
    minutes = [s / 60 for _, s, *_ in fits]
    print(f"vLLM's defaults on the simulator, CPU demo workload (at most 1000 requests a probe), TTFT P99 <= 150 ms; "
          f"noise run_cv {args.run_cv}, replay_cv {args.replay_cv}; {args.trials} trials")
    for f, s, same, fresh, before in rows:
        print(f"  trial: {f.rate_rps:7.2f} req/s [{f.low_rps:.2f}, {f.high_rps:.2f}] +-{f.half_width:5.1%} "
              f"(the counts' own: +-{before.half_width:5.1%}; {f.requests} requests, {s / 60:.1f} min)   "
              f"re-measured: same engine {same.rate_rps if same else float('nan'):7.2f}, fresh engine "
              f"{fresh.rate_rps if fresh else float('nan'):7.2f}" if f else "  trial: no rate passed")
    print(f"replay per trial: median {statistics.median(minutes):.2f} min of sending "
          f"({time.perf_counter() - t0:.0f} s)")
    print("| interval | half-width median | worst | precision per minute (half-width x sqrt(min)), median | "
          "covers, same engine | covers, fresh engine |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, at in (("profile + block bootstrap (the counts' own)", 4), ("+ a re-measurement's share (now)", 0)):
        halves = [r[at].half_width for r in fits]
        per_minute = [h * m ** 0.5 for h, m in zip(halves, minutes)]
        # out of the trials whose re-measurement found a rate (its pooled fit can fail on a draw: not a miss)
        same_n, fresh_n = (sum(1 for r in fits if r[k] is not None) for k in (2, 3))
        same = sum(1 for r in fits if r[2] is not None and r[at].contains(r[2].rate_rps))
        fresh = sum(1 for r in fits if r[3] is not None and r[at].contains(r[3].rate_rps))
        print(f"| {name} | {statistics.median(halves):.1%} | {max(halves):.1%} | "
              f"{statistics.median(per_minute):.3f} | {same}/{same_n} | {fresh}/{fresh_n} |")
    # what the interval is for: how far the trial's rate lies from the rate re-measured on the same engine (20 000
    # requests: the machine's start is the trial's own, the draws are others)
    errors = [math.log(r[0].rate_rps / r[2].rate_rps) for r in fits if r[2] is not None]
    if errors:
        rms = math.sqrt(statistics.mean(e * e for e in errors))
        print(f"\nthe trial's rate against the same engine's re-measurement: root mean square {rms:.1%}, median "
              f"|error| {statistics.median(abs(e) for e in errors):.1%} ({len(errors)} trials); x sqrt(median "
              f"minutes): {rms * statistics.median(minutes) ** 0.5:.3f}")


if __name__ == "__main__":
    main()
