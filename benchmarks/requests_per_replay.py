"""Requests per replay: `--num-requests auto` (a pilot chooses) against counts fixed by hand, on the simulator.

    .venv/bin/python benchmarks/requests_per_replay.py [--seeds 8] [--budget 40] [--calibration FILE]

Each seed runs the default study (`optimizer.runner.prepare` + `run`: pilot, sampler, rate search, incumbent
early stop, records in SQLite) on the simulated engine three times: with 120 requests per replay (the CPU
demo's count: its P99 is the slowest request or two), with 1000 (`vllm bench serve`'s default
`--num-prompts`, what a careful hand-tuner replays), and with `auto`. Seed s draws the workload with seed s and
seeds the sampler with s. Costs are the simulated engine's modelled seconds (`SimulatedEngine.virtual_s`: start,
replays, shutdown; the pilot's included for auto).

What wins is judged on data the study never saw: each recommendation (highest feasible trial) is replayed on a
fresh workload of 3000 requests (workload seed 1000 + s) at the rate its study claimed: does its TTFT P99 hold
the limit there? And each is measured alone on that fresh workload with a fine rate search: its true goodput.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna  # noqa: E402

from optimizer.config.model import DEFAULT_MODEL_NAME, inspect_model  # noqa: E402
from optimizer.config.settings import RateSearchSpec, StudyConfig  # noqa: E402
from optimizer.config.workload_spec import CPU_DEMO_WORKLOAD, WorkloadSpec  # noqa: E402
from optimizer.core.units import parse_duration_ms  # noqa: E402
from optimizer.engines.sim.steptime import StepTimeModel  # noqa: E402
from optimizer.engines.simulated import SimulatedEngine  # noqa: E402
from optimizer.measurement.metrics import summarize  # noqa: E402
from optimizer.measurement.workload import build_workload  # noqa: E402
from optimizer.params.space import resolve  # noqa: E402
from optimizer.search.attrs import BASELINE, ENGINE_PARAMS  # noqa: E402
from optimizer.search.measured import measurement_of  # noqa: E402
from optimizer.search.prescreen import evaluate, sim_objective  # noqa: E402
from optimizer.search.runner import model_path, prepare, run  # noqa: E402
from optimizer.search.score import goodput  # noqa: E402
from optimizer.search.confirmed import recommended  # noqa: E402

VARIANTS = ("120", "1000", "auto")
FRESH_REQUESTS = 3000
FINE_SEARCH = RateSearchSpec(max_replays=12)


@dataclass
class Outcome:
    variant: str
    seed: int
    num_requests: int
    engine_s: float
    replay_s: float
    params: dict[str, Any] | None
    claimed_rate_rps: float | None
    claimed_tok_s: float
    holds: bool = False  # its TTFT P99 on the fresh workload at the claimed rate is within the limit
    fresh_p99_ms: float = math.nan
    true_tok_s: float = 0.0  # measured alone on the fresh workload, fine rate search


def study_config(variant: str, seed: int, slo_ms: float, budget: int, root: Path) -> StudyConfig:
    workload = WorkloadSpec(**{**CPU_DEMO_WORKLOAD, "seed": seed,
                               "num_requests": CPU_DEMO_WORKLOAD["num_requests"] if variant == "auto"
                               else int(variant)})
    return StudyConfig(study_name=f"{variant}-{seed}", storage_url=f"sqlite:///{root}/{variant}-{seed}.db",
                       ttft_p99_ms=slo_ms, budget=budget, model=DEFAULT_MODEL_NAME, model_is_default=True,
                       device="cpu", seed=seed, workload=workload, num_requests_auto=variant == "auto",
                       engine_args={"enforce_eager": True})


def run_variant(variant: str, seed: int, slo_ms: float, budget: int, tm: StepTimeModel, root: Path) -> Outcome:
    config = study_config(variant, seed, slo_ms, budget, root)
    info = inspect_model(model_path(config))
    engines: list[SimulatedEngine] = []

    def factory() -> SimulatedEngine:
        engines.append(SimulatedEngine(info, tm))
        return engines[-1]

    prepared = prepare(config, root, say=lambda *a: None, engine_factory=factory, memory_probe=lambda: None)
    run(prepared, quiet=True)
    per_start = tm.engine_start_s + tm.engine_shutdown_s
    best = recommended(prepared.study)
    rate = m.rate_rps if best is not None and (m := measurement_of(best)) is not None else None
    return Outcome(variant, seed, prepared.config.workload.num_requests, sum(e.virtual_s for e in engines),
                   sum(max(e.virtual_s - per_start, 0.0) for e in engines),
                   {**ENGINE_PARAMS.of(best)} if best else None,
                   math.inf if best and rate is None else rate, goodput(best) if best else 0.0)


def judge(outcome: Outcome, slo_ms: float, tm: StepTimeModel, root: Path) -> None:
    """The recommendation on a fresh, long workload: at its claimed rate, and alone with a fine rate search."""
    if outcome.params is None:
        return
    config = study_config("1000", outcome.seed, slo_ms, 1, root)
    fresh_spec = config.workload.model_copy(update={"seed": 1000 + outcome.seed, "num_requests": FRESH_REQUESTS})
    info = inspect_model(model_path(config))
    fresh = build_workload(fresh_spec, info.vocab_size)
    engine = SimulatedEngine(info, tm)
    asyncio.run(engine.start(dict(outcome.params)))
    rate = outcome.claimed_rate_rps or math.inf
    records = engine.simulate_replay(fresh.requests, fresh.arrivals_s(rate))
    m = summarize(records, rate)
    outcome.fresh_p99_ms = m.ttft.p99_ms
    outcome.holds = m.ttft.p99_ms <= slo_ms and m.sustained
    cfg = config.model_copy(update={"workload": fresh_spec, "search": FINE_SEARCH, "num_requests_auto": False})
    space = resolve(cfg.space, "cpu", info.max_len, cfg.workload)
    searched = {k: v for k, v in outcome.params.items() if k in space.dists}
    if not searched:  # vLLM's defaults won: measured as the baseline is (no searched knob set)
        study = optuna.create_study(directions=["maximize", "minimize"])
        study.enqueue_trial({}, user_attrs=BASELINE.item(True))
        study.optimize(sim_objective(cfg, space, fresh, info, tm, root, early_stop=False), n_trials=1)
        outcome.true_tok_s = goodput(study.trials[0])
        return
    (trial,) = evaluate(sim_objective(cfg, space, fresh, info, tm, root), [searched])
    outcome.true_tok_s = goodput(trial)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--budget", type=int, default=40)
    p.add_argument("--ttft-p99", default="150ms")
    p.add_argument("--calibration", help="a step-time model written by `optimize calibrate` (default: nominal)")
    args = p.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    slo_ms = parse_duration_ms(args.ttft_p99, "--ttft-p99")
    tm = StepTimeModel.load(args.calibration) if args.calibration else StepTimeModel()
    root = Path(tempfile.mkdtemp(prefix="requests-per-replay-"))
    t0 = time.perf_counter()
    outcomes: list[Outcome] = []
    for seed in range(args.seeds):
        for variant in VARIANTS:
            o = run_variant(variant, seed, slo_ms, args.budget, tm, root)
            judge(o, slo_ms, tm, root)
            outcomes.append(o)
            print(f"  seed {seed} {variant:>5}: {o.num_requests} req/replay, replays {o.replay_s / 60:.1f} engine min, "
                  f"claims {o.claimed_tok_s:.1f} tok/s at {o.claimed_rate_rps or 0:.2f} req/s; fresh P99 there "
                  f"{o.fresh_p99_ms:.0f} ms ({'holds' if o.holds else 'MISSES'}); alone {o.true_tok_s:.1f} tok/s",
                  flush=True)
    print()
    print(f"TTFT P99 <= {slo_ms:.0f} ms, {args.seeds} seeds x {args.budget} trials, simulated engine "
          f"({'calibrated: ' + args.calibration if args.calibration else 'nominal time model'}); medians over seeds")
    print(f"{'requests/replay':<17}{'count':>7}{'replay min':>12}{'engine min':>12}{'claimed tok/s':>15}"
          f"{'fresh P99 med/max':>19}{'holds':>9}{'alone tok/s':>13}{'vs 1000':>9}")
    by = {v: [o for o in outcomes if o.variant == v] for v in VARIANTS}
    ref = {o.seed: o.true_tok_s for o in by["1000"]}
    for v in VARIANTS:
        rows = by[v]
        ratio = [o.true_tok_s / ref[o.seed] for o in rows if ref.get(o.seed)]
        print(f"{v:<17}{statistics.median(o.num_requests for o in rows):>7.0f}"
              f"{statistics.median(o.replay_s for o in rows) / 60:>12.1f}"
              f"{statistics.median(o.engine_s for o in rows) / 60:>12.1f}"
              f"{statistics.median(o.claimed_tok_s for o in rows):>15.1f}"
              f"{statistics.median(o.fresh_p99_ms for o in rows):>12.0f} / {max(o.fresh_p99_ms for o in rows):<4.0f}"
              f"{sum(o.holds for o in rows):>4} of {len(rows):<2}"
              f"{statistics.median(o.true_tok_s for o in rows):>13.1f}"
              f"{statistics.median(ratio) if ratio else math.nan:>9.3f}")
    auto, fixed = by["auto"], by["1000"]
    saved = [1 - a.replay_s / f.replay_s for a, f in zip(auto, fixed) if f.replay_s > 0]
    ratios = [a.true_tok_s / f.true_tok_s for a, f in zip(auto, fixed) if f.true_tok_s > 0]
    print(f"auto vs 1000 per study: replay time saved median {statistics.median(saved):.0%} "
          f"(range {min(saved):.0%} to {max(saved):.0%}); winner alone on fresh data, auto / 1000: median "
          f"{statistics.median(ratios):.3f}, min {min(ratios):.3f} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
