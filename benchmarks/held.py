"""Held against independent replays: a finished study's vLLM defaults and leader (the configs its confirmation served,
search/confirm.py), each measured at the rate the study reports and at 1.15 x it, with fresh draws of 1000 or more
requests and 3 runs each, in both backends, each engine after the study's warm-up under load (as a trial's); each
engine starts on another draw (the k-th engine on draw k + --rotate, mod --runs), so that a draw's tail and an
engine's first run are told apart:

- in process (AsyncLLM, the backend the search and the rounds measured with): this project's replay of the draw at the
  rate to provision for in process that the study reports (decision/served.py::provision_rps; `--at median`: the
  median over the rounds, `--at lowest`: the lowest round);
- as served (`vllm serve` over HTTP): vLLM's own benchmark client (`vllm bench serve`'s module, fed the same draw as a
  timed_trace, benchmarks/parity.py) at the rate to provision for as served (`--at median` or `lowest`: the rate at
  the limit that the study's run through `vllm serve` found).

Prints one row per config, backend and factor with the TTFT P99 of every run, by draw (^: the engine's first run at
that factor), and the verdict the issue asks for: at
the reported rate, TTFT P99 under the limit in every run ("holds"); at 1.15 x, over the limit or fallen behind in most
runs ("breaks"). Each run draws its own requests (seed + 100 + run), never a draw the study measured. In process each
run's line also gives its TTFT P99 by fifths of the replay: a queue that builds rises fifth by fifth, a stall shows
in one, and a machine slower as a whole lifts them all.

    flock /tmp/optimizer-engine.lock .venv/bin/python benchmarks/held.py --studies-dir DIR --study NAME [--runs 3]
        [--at provision|median|lowest]   (the rate: the one to provision for, the median over the rounds, the lowest)
        [--in-process-only] [--trial N] [--rotate K] [--rescale N]

A shared machine's speed moves over hours (the same config's rate at the limit, same code and draw, read 70-78 req/s
in a study's rounds and 83-95 two hours later on the same 2-core Xeon): a check run long after its study tests the
machine's drift as much as the study's numbers. `--rescale N` measures vLLM's defaults again first, N trials through
the study's own objective (on a scratch copy of the study: the original is not written), and multiplies every rate
held by their median over the defaults' median in the study's rounds (in process): the study's numbers at the
machine's speed now, vLLM's defaults the yardstick, as the confirmation's gains are. Printed: the trials' rates, the
factor, and each rate before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna  # noqa: E402

from optimizer.cli.common import existing_config  # noqa: E402
from optimizer.core.clock import MonotonicClock  # noqa: E402
from optimizer.decision.decide import decide  # noqa: E402
from optimizer.decision.served import provision_rps  # noqa: E402
from optimizer.engines.http_engine import HttpEngine, RemoteEngine  # noqa: E402
from optimizer.engines.vllm_engine import VllmEngine  # noqa: E402
from optimizer.measurement.metrics import summarize  # noqa: E402
from optimizer.measurement.replay import replay  # noqa: E402
from optimizer.measurement.workload import build_workload  # noqa: E402
from optimizer.config.model import inspect_model  # noqa: E402
from optimizer.search.attrs import BASELINE, ENGINE_PARAMS, RUN  # noqa: E402
from optimizer.search.confirmed import run_rate_rps  # noqa: E402
from optimizer.search.runner import engine_base_args, model_path, prepare  # noqa: E402
from optimizer.search.study import default_storage_url, storage_for  # noqa: E402

from parity import timed_trace, vllm_bench  # noqa: E402 (benchmarks/parity.py: vLLM's own client)

FACTORS = (1.0, 1.15)


def draws(config, vocab_size: int, n: int, runs: int) -> list:
    return [build_workload(config.workload.model_copy(update={"num_requests": n, "seed": config.workload.seed + 100
                                                              + k}), vocab_size) for k in range(runs)]


async def warm_up_under_load(engine, workload, rate: float, count: int, clock) -> None:
    """As a trial does before its first probe (search/probes.py): the draw's first `count` requests at the rate,
    measured nowhere, so that no run pays for the engine's first replays after its start."""
    if count:
        await engine.reset_prefix_cache()
        await replay(engine, workload.requests[:count], workload.arrivals_s(rate)[:count], clock)


async def in_process(base: dict[str, Any], deploy_as: str, params: dict[str, Any], rate: float, workloads: list,
                     log: Path, probe_cap: int, warm: int) -> dict[float, list[tuple[int, float, bool]]]:
    """(draw, TTFT P99 ms, fell behind) per run, per factor, on one engine after the study's warm-up under load
    (`warm` requests), the prefix cache reset before every run; `workloads`: (draw, workload) in the order run;
    each run's first `probe_cap` requests (the study's probe cap) are summarized too, printed only."""
    engine = VllmEngine(base, deploy_as=deploy_as)
    await engine.start(params, log)
    out: dict[float, list[tuple[int, float, bool]]] = {}
    try:
        clock = MonotonicClock()
        opening = workloads[0][1]
        await replay(engine, opening.warmup, [0.0] * len(opening.warmup), clock)
        await warm_up_under_load(engine, opening, rate, warm, clock)
        for k, w in workloads:
            for f in FACTORS:
                await engine.reset_prefix_cache()
                records = await replay(engine, w.requests, w.arrivals_s(rate * f), clock)
                m = summarize(records, rate * f)
                out.setdefault(f, []).append((k, m.ttft.p99_ms, m.falls_behind))
                # the same run cut at the study's probe cap: how much of a miss is the longer replay's queue
                sent = sorted(records, key=lambda r: r.sent_s)
                first = sent[:probe_cap]
                # by fifths of the replay: a queue that builds over it rises fifth by fifth, a stall shows in one
                fifths = [summarize(sent[i * len(sent) // 5:(i + 1) * len(sent) // 5], rate * f).ttft.p99_ms
                          for i in range(5)]
                print(f"  in process {rate * f:.2f} req/s, draw {k}: TTFT P99 {m.ttft.p99_ms:.0f} ms"
                      f"{', fell behind' if m.falls_behind else ''}; its first {len(first)} requests: "
                      f"{summarize(first, rate * f).ttft.p99_ms:.0f} ms; by fifths: "
                      f"{', '.join(f'{x:.0f}' for x in fifths)} ms", flush=True)
    finally:
        await engine.shutdown()
    return out


async def as_served(base: dict[str, Any], params: dict[str, Any], rate: float, workloads: list, work: Path,
                    log: Path, warm: int) -> dict[float, list[tuple[int, float, bool]]]:
    """(draw, TTFT P99 ms, fell behind: completed under 90% of the offered rate) per run and factor, vLLM's own
    client; `workloads`: (draw, workload) in the order run."""
    server = HttpEngine(base)
    await server.start(params, log)
    remote = RemoteEngine(server.base_url)
    out: dict[float, list[tuple[int, float, bool]]] = {}
    try:
        await remote.start({})
        clock = MonotonicClock()
        opening = workloads[0][1]
        await replay(remote, opening.warmup, [0.0] * len(opening.warmup), clock)
        await warm_up_under_load(remote, opening, rate, warm, clock)
        for k, w in workloads:
            for f in FACTORS:
                await remote.reset_prefix_cache()
                trace = timed_trace(w, rate * f, work / f"trace-{k}-{f:g}.jsonl")
                got = await asyncio.to_thread(vllm_bench, server.base_url, remote.model_name, trace,
                                              len(w.requests), work / f"vllm-{k}-{f:g}.json")
                behind = got["completed"] / got["duration_s"] < 0.9 * rate * f
                out.setdefault(f, []).append((k, got["ttft_p99_ms"], behind))
                print(f"  as served {rate * f:.2f} req/s, draw {k} (vLLM's client): TTFT P99 "
                      f"{got['ttft_p99_ms']:.0f} ms{', behind' if behind else ''}", flush=True)
    finally:
        await remote.shutdown()
        await server.shutdown()
    return out


def verdict(runs: dict[float, list[tuple[int, float, bool]]], limit_ms: float) -> str:
    at = all(p99 <= limit_ms and not behind for _, p99, behind in runs[1.0])
    above = sum(p99 > limit_ms or behind for _, p99, behind in runs[FACTORS[1]]) > len(runs[FACTORS[1]]) / 2
    return f"{'holds' if at else 'MISSES'} at the rate, {'breaks' if above else 'DOES NOT BREAK'} at 1.15x"


def decided(studies_dir: Path, name: str):
    """A finished study's stored config and its decision (decision/decide.py), or an exit that says what is missing."""
    url = default_storage_url(name, studies_dir)
    config = existing_config(url, name)
    if config is None:
        raise SystemExit(f"no study {name!r} in {studies_dir}")
    return config, decide(optuna.load_study(study_name=name, storage=storage_for(url)), config)


def defaults_now(config, studies_dir: Path, trials: int) -> list[float]:
    """vLLM's defaults' rate at the limit now: `trials` trials through the study's own objective (engine start,
    warm-up, probes sized by evidence, the pooled fit's rate, read as a confirmation run's: `run_rate_rps`), early
    stopping off, on a scratch copy of the study's SQLite database (the study itself is not written); trials that met
    the limit nowhere are left out."""
    url = default_storage_url(config.study_name, studies_dir)
    if not url.startswith("sqlite:///"):
        raise SystemExit("--rescale copies the study's SQLite database; this study is not in one")
    with tempfile.TemporaryDirectory(prefix="held-rescale-") as d:
        copy = Path(d) / Path(url.removeprefix("sqlite:///")).name
        shutil.copyfile(url.removeprefix("sqlite:///"), copy)
        scratch = config.model_copy(update={"storage_url": f"sqlite:///{copy}"})
        prepared = prepare(scratch, Path(d), say=lambda *a: None, live=False)
        prepared.objective.early_stop = False  # each trial does its whole rate search
        prepared.objective.records = None
        before = len(prepared.study.trials)
        for _ in range(trials):
            prepared.study.enqueue_trial({}, user_attrs={**RUN.item(True), **BASELINE.item(True)})
        prepared.study.optimize(prepared.objective, n_trials=trials)
        rates = [run_rate_rps(t) for t in prepared.study.trials[before:]]  # the pooled fit's, as a round's run
    return [r for r in rates if 0 < r < math.inf]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--studies-dir", default="studies")
    p.add_argument("--study", default="default")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--out", default=None, help="folder for traces, vLLM's result JSONs and logs (default: a temp dir)")
    p.add_argument("--at", choices=("provision", "median", "lowest"), default="provision",
                   help="the rate held: the one the study says to provision for (in process and as served), the "
                        "confirmation's median over its rounds (the rate at the limit), or its lowest round's")
    p.add_argument("--trial", type=int, action="append",
                   help="hold only this config (a trial number among the configs served; repeatable)")
    p.add_argument("--in-process-only", action="store_true",
                   help="skip the runs as served (at a few req/s, 1000 requests through vllm serve take many minutes)")
    p.add_argument("--rotate", type=int, default=0, help="the first engine starts on this draw (the next on the next)")
    p.add_argument("--rescale", type=int, default=0, metavar="N",
                   help="first measure vLLM's defaults again in N trials of the study's objective, and hold every rate "
                        "times their median over the defaults' median in the study's rounds (the machine's speed now)")
    args = p.parse_args()
    config, d = decided(Path(args.studies_dir), args.study)
    c = d.confirmation
    if c is None or not c.served_configs:
        raise SystemExit("the study has no confirmation with runs as served: run optimize with --served (default)")
    path = model_path(config)
    base = engine_base_args(config, path)
    work = Path(args.out or tempfile.mkdtemp(prefix="held-"))
    work.mkdir(parents=True, exist_ok=True)
    workloads = draws(config, inspect_model(path, config.dummy_weights).vocab_size, args.num_requests, args.runs)
    limit = config.ttft_p99_ms
    warm = min(config.workload.warmup_load_requests, args.num_requests)
    rows, starts = [], itertools.count(args.rotate)
    speed = 1.0
    if args.rescale:
        base_run = c.base
        then = c.rate_interval(base_run).median if base_run is not None else None
        if not (then and math.isfinite(then) and then > 0):
            raise SystemExit("--rescale needs vLLM's defaults with a rate at the limit in the study's rounds")
        now = defaults_now(config, Path(args.studies_dir), args.rescale)
        if not now:
            raise SystemExit("--rescale: vLLM's defaults met the limit at no rate now")
        speed = statistics.median(now) / then
        print(f"machine speed now: vLLM's defaults hold {statistics.median(now):.2f} req/s (trials: "
              f"{', '.join(f'{v:.2f}' for v in now)}) against {then:.2f} in the study's rounds (median): every rate "
              f"below is the study's x {speed:.3f}", flush=True)

    def order() -> list:  # (draw, workload), each engine starting on the next draw
        start = next(starts)
        return [(k % args.runs, workloads[k % args.runs]) for k in range(start, start + args.runs)]

    for x in c.served_configs:
        if args.trial and x.number not in args.trial:
            continue
        params = ENGINE_PARAMS.of(x.trial)
        name = f"#{x.number}" + (" (vLLM's defaults)" if x.baseline else "")
        rates = [v for r in c.full_rounds if (v := x.rate_rps(r)) is not None]
        inproc_rate = {"median": c.rate_interval(x).median, "lowest": min(rates),
                       "provision": provision_rps(c, x)}[args.at]
        if inproc_rate is None:
            raise SystemExit(f"{name} has no rate to provision for (fewer than two rounds): use --at median")
        if speed != 1.0:
            print(f"{name}: in process the study's {inproc_rate:.2f} req/s x {speed:.3f}", flush=True)
            inproc_rate *= speed
        print(f"{name}: in process at {inproc_rate:.2f} req/s ({args.at}; its rounds: "
              f"{', '.join(f'{v:.2f}' for v in rates)}) and 1.15x, {args.runs} runs of {args.num_requests}", flush=True)
        rows.append((name, "in process", inproc_rate,
                     asyncio.run(in_process(base, config.deploy_as, params, inproc_rate, order(),
                                            work / f"inproc-{x.number}.log", config.workload.num_requests,
                                            warm))))
        if args.in_process_only:
            continue
        if x.served_rate is None:
            print(f"{name}: as served not measured (its run through vllm serve found no rate at the limit)")
        else:
            served_rate = provision_rps(c, x, served=True) if args.at == "provision" else x.served_rate.rate_rps
            if speed != 1.0:
                print(f"{name}: as served the study's {served_rate:.2f} req/s x {speed:.3f}", flush=True)
                served_rate *= speed
            print(f"{name}: as served at {served_rate:.2f} req/s and 1.15x (vLLM's client)", flush=True)
            rows.append((name, "as served", served_rate,
                         asyncio.run(as_served(base, params, served_rate, order(), work,
                                               work / f"served-{x.number}.log", warm))))
    scaled = f"; rates: the study's x {speed:.3f} (the machine's speed now, --rescale)" if args.rescale else ""
    print(f"\nTTFT P99 limit {limit:.0f} ms; {args.runs} runs of {args.num_requests} requests each, fresh draws; "
          f"files in {work}{scaled}")
    print(f"{'config':<22} {'backend':<11} {'rate':>7} | {'TTFT P99 ms at the rate, by draw':<26} | "
          f"{'at 1.15x':<26} | verdict")
    for name, backend, rate, runs in rows:
        cell = {f: ", ".join(f"{p99:.0f}{'*' if behind else ''}{'^' if (k, p99, behind) == runs[f][0] else ''}"
                             for k, p99, behind in sorted(runs[f])) for f in FACTORS}
        print(f"{name:<22} {backend:<11} {rate:>7.2f} | {cell[1.0]:<26} | {cell[FACTORS[1]]:<26} | "
              f"{verdict(runs, limit)}")
    print("*: fell behind (backlog grew over the arrivals in process; as served, completed under 90% of the rate); "
          "^: the engine's first run")
    print("medians: " + "; ".join(f"{n} {b} {statistics.median(p for _, p, _ in r[1.0]):.0f}/"
                                  f"{statistics.median(p for _, p, _ in r[FACTORS[1]]):.0f} ms" for n, b, _, r in rows))


if __name__ == "__main__":
    main()
