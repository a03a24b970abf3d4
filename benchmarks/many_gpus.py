"""Trials per hour with 1, 2, 4 and 8 GPUs under `--gpus`, in the simulated engine's modelled time.

    .venv/bin/python benchmarks/many_gpus.py [--trials 48] [--layouts 1,2,4] [--seed 0]

1. Draws `--trials` configs of the GPU demo's space at random (seeded), `tensor_parallel_size` among `--layouts`,
   and measures each as one trial of the simulated engine on logical H100s (the study's own objective, no early
   stop): its rate at the limit, its throughput per GPU and its modelled length (engine start, every probe, shutdown:
   `SimulatedEngine.virtual_s`).
2. Places them as `--gpus N` does, in modelled time: N slots, each taking the next trial in order as soon as it is
   idle, the trial waiting until its layout's GPUs are free (the pool's own choice, `gpu_pool.choose_group`, on an
   8-GPU server's topology: NVLink islands of four), a waiting trial that fits going first in order of waiting.
3. Prints per N: the trials' makespan, trials per hour, the speed-up over one GPU, the GPUs' busy share, and the
   best throughput per GPU found by the time the 8-GPU run has finished every trial (one GPU has by then run a
   fraction of them).

The modelled lengths are the simulator's time model (nominal, or `--calibration`), not a GPU's; the placement is the
product's. What it does not model: a slot process's start (seconds, once per run) and the database's writes.
"""

from __future__ import annotations

import argparse
import heapq
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import optuna

from optimizer.config.demo import demo_for
from optimizer.config.settings import StudyConfig
from optimizer.hardware.gpu_pool import choose_group, logical_topology
from optimizer.params.space import parse_space_yaml
from optimizer.search.measured import measurement_of
from optimizer.search.prescreen import evaluate
from optimizer.search.runner import prepare


@dataclass(frozen=True)
class Measured:
    gpus: int
    length_s: float  # modelled: start, probes, shutdown
    tok_s_per_gpu: float  # 0 where it met the limit nowhere


def measure(trials: int, layouts: list[int], seed: int, calibration: str | None) -> list[Measured]:
    """`trials` random configs of the GPU demo's space with tensor_parallel_size among `layouts`, each measured once
    on the simulated engine."""
    work = Path(tempfile.mkdtemp(prefix="many-gpus-"))
    space = parse_space_yaml({"tensor_parallel_size": layouts}).model_dump()
    config = StudyConfig(study_name="bench", storage_url=f"sqlite:///{work}/bench.db", ttft_p99_ms=150.0,
                         budget=trials, device="cuda", engine="sim", space=space, calibration=calibration,
                         **demo_for("cuda", None, None).settings())  # the GPU demo, as `optimize` picks it
    prepared = prepare(config, work, say=lambda *a: None, live=False)
    objective = prepared.objective
    engines = []
    make = objective.engine_factory

    def recorded():
        engine = make()
        engines.append(engine)
        return engine

    draws = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed))
    params_list = []
    for _ in range(trials):
        t = draws.ask()
        params_list.append(objective.space.suggest(t))
    made = []  # engines made by the end of each trial: one pruned before its engine is made has none
    done = evaluate(replace(objective, engine_factory=recorded), params_list,
                    callbacks=[lambda s, t: made.append(len(engines))])
    out = []
    for k, (t, params) in enumerate(zip(done, params_list)):
        if made[k] == (made[k - 1] if k else 0):
            continue  # refused before any start: no time spent, not a trial a slot runs
        m = measurement_of(t)
        gpus = int(params.get("tensor_parallel_size", 1))
        per_gpu = m.output_throughput_tok_s / gpus if m is not None and m.feasible else 0.0
        out.append(Measured(gpus, engines[made[k] - 1].virtual_s, per_gpu))
    return out


def place(trials: list[Measured], gpus: int) -> tuple[float, list[float]]:
    """Pure: the makespan of `trials` run by `gpus` slots on `gpus` GPUs as `--gpus` places them, and each trial's
    end (inf for a layout larger than the pool, pruned at once)."""
    topology = logical_topology(gpus)
    free = set(range(gpus))
    ends = [float("inf")] * len(trials)
    running: list[tuple[float, int, tuple[int, ...]]] = []
    waiting: list[int] = []
    nxt, idle, now = 0, gpus, 0.0
    while nxt < len(trials) or waiting or running:
        while idle and nxt < len(trials):  # an idle slot takes the next trial
            if trials[nxt].gpus <= gpus:
                waiting.append(nxt)
                idle -= 1
            nxt += 1
        for i in list(waiting):  # in order of waiting, each that fits now starts
            group = choose_group(topology, free, trials[i].gpus)
            if group is not None:
                free -= set(group)
                waiting.remove(i)
                heapq.heappush(running, (now + trials[i].length_s, i, group))
        if not running:
            break
        now, i, group = heapq.heappop(running)
        free |= set(group)
        ends[i] = now
        idle += 1
    return now, ends


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=48)
    p.add_argument("--layouts", default="1", help="tensor_parallel_size choices (default 1; e.g. 1,2,4: the pools of "
                   "at least 4 GPUs are compared)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibration", help="a step-time model from `optimize calibrate` (default: the nominal one)")
    args = p.parse_args()
    layouts = [int(x) for x in args.layouts.split(",")]
    trials = measure(args.trials, layouts, args.seed, args.calibration)
    sizes = {g: sum(1 for t in trials if t.gpus == g) for g in layouts}
    print(f"{len(trials)} trials of the GPU demo on the simulated engine; layouts (GPUs: trials) {sizes}; modelled "
          f"length {min(t.length_s for t in trials):.0f}-{max(t.length_s for t in trials):.0f} s")
    pools = [n for n in (1, 2, 4, 8) if n >= max(layouts)]  # every trial fits: the pools compare
    results = {n: place(trials, n) for n in pools}
    at = results[8][0]  # the 8-GPU run's end: what each pool had found by then
    base = None
    print(f"{'GPUs':>4}  {'makespan h':>10}  {'trials/h':>8}  {f'vs {pools[0]} GPU':>8}  {'GPU busy':>8}  "
          f"{'done at T':>9}  {'best tok/s/GPU at T':>19}")
    for n, (makespan, ends) in results.items():
        ran = [t for t, e in zip(trials, ends) if e != float("inf")]
        per_hour = len(ran) / makespan * 3600
        base = base or per_hour
        busy = sum(t.length_s * t.gpus for t in ran) / (n * makespan)
        by_t = [t for t, e in zip(trials, ends) if e <= at]
        best = max((t.tok_s_per_gpu for t in by_t), default=0.0)
        print(f"{n:>4}  {makespan / 3600:>10.2f}  {per_hour:>8.1f}  {per_hour / base:>7.2f}x  {busy:>8.0%}  "
              f"{len(by_t):>9}  {best:>19.1f}")
    print(f"T = {at / 3600:.2f} h, the 8-GPU run's makespan")


if __name__ == "__main__":
    main()
