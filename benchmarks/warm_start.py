"""Warm starts against vLLM's own (spawn) on the CPU build: the start's time, and that what a replay measures is the
same (optimizer/engines/warm_start.py).

Alternating rounds (cold then warm, warm then cold, ...), each on a fresh engine of one config of a finished study
(its workload, model and dtype; vLLM's defaults unless `--trial`), the prefix cache reset: one replay of a fresh draw
at `--rate` req/s. Prints per engine the start's seconds, the KV cache vLLM sized, TTFT P50/P99, completions per
second and whether the backlog grew, then the medians per kind and the ratio warm/cold of each.

    flock /tmp/optimizer-engine.lock .venv/bin/python benchmarks/warm_start.py --studies-dir DIR --study NAME
        --rate RPS [--rounds 4] [--num-requests 1000] [--trial N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna  # noqa: E402

from optimizer.cli.common import existing_config  # noqa: E402
from optimizer.config.model import inspect_model  # noqa: E402
from optimizer.core.clock import MonotonicClock  # noqa: E402
from optimizer.engines.vllm_engine import VllmEngine  # noqa: E402
from optimizer.measurement.metrics import summarize  # noqa: E402
from optimizer.measurement.replay import replay  # noqa: E402
from optimizer.measurement.workload import build_workload  # noqa: E402
from optimizer.search.attrs import ENGINE_PARAMS  # noqa: E402
from optimizer.search.runner import engine_base_args, model_path  # noqa: E402
from optimizer.search.study import default_storage_url, storage_for  # noqa: E402

COLUMNS = ("start_s", "kv_blocks", "ttft_p50_ms", "ttft_p99_ms", "completed_rps")


async def one_engine(base: dict, deploy_as: str, params: dict, warm: bool, workload, rate: float, log: Path) -> dict:
    engine = VllmEngine(base, deploy_as=deploy_as, warm_starts=warm)
    t0 = time.monotonic()
    resolved = await engine.start(params, log)
    start_s = time.monotonic() - t0
    try:
        clock = MonotonicClock()
        await replay(engine, workload.warmup, [0.0] * len(workload.warmup), clock)
        await engine.reset_prefix_cache()
        m = summarize(await replay(engine, workload.requests, workload.arrivals_s(rate), clock), rate)
    finally:
        await engine.shutdown()
    return {"start_s": start_s, "kv_blocks": resolved["num_kv_blocks"], "ttft_p50_ms": m.ttft.p50_ms,
            "ttft_p99_ms": m.ttft.p99_ms, "completed_rps": m.achieved_rate_rps, "behind": m.falls_behind}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--studies-dir", default="studies")
    p.add_argument("--study", default="default")
    p.add_argument("--rate", type=float, required=True, help="offered req/s of every replay")
    p.add_argument("--rounds", type=int, default=4, help="pairs of engines, one cold and one warm each")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--trial", type=int, default=None, help="the config of this trial (default: vLLM's defaults)")
    p.add_argument("--out", default="/tmp/warm-start-bench")
    args = p.parse_args()
    url = default_storage_url(args.study, Path(args.studies_dir))
    config = existing_config(url, args.study)
    if config is None:
        raise SystemExit(f"no study {args.study!r} in {args.studies_dir}")
    study = optuna.load_study(study_name=args.study, storage=storage_for(url))
    trial = study.trials[args.trial or 0]
    params = ENGINE_PARAMS.of(trial)
    path = model_path(config)
    base = engine_base_args(config, path)
    vocab = inspect_model(path, config.dummy_weights).vocab_size
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"trial #{trial.number} {params}, {args.num_requests} requests at {args.rate:.2f} req/s, "
          f"{args.rounds} rounds")
    rows: dict[bool, list[dict]] = {False: [], True: []}
    for k in range(args.rounds):
        workload = build_workload(config.workload.model_copy(update={"num_requests": args.num_requests,
                                                                      "seed": config.workload.seed + 200 + k}), vocab)
        for warm in ((False, True) if k % 2 == 0 else (True, False)):
            row = asyncio.run(one_engine(base, config.deploy_as, params, warm, workload, args.rate,
                                         out / f"round{k}-{'warm' if warm else 'cold'}.log"))
            rows[warm].append(row)
            print(f"round {k} {'warm' if warm else 'cold'}: " + ", ".join(f"{c} {row[c]:.2f}" for c in COLUMNS)
                  + (" (fell behind)" if row["behind"] else ""), flush=True)
    print(f"\nmedians over {args.rounds} rounds (logs in {out}):")
    print(f"{'':6}" + "".join(f"{c:>15}" for c in COLUMNS))
    med = {w: {c: statistics.median(r[c] for r in rows[w]) for c in COLUMNS} for w in (False, True)}
    for w in (False, True):
        print(f"{'warm' if w else 'cold':6}" + "".join(f"{med[w][c]:>15.2f}" for c in COLUMNS))
    print(f"{'w/c':6}" + "".join(f"{med[True][c] / med[False][c]:>15.3f}" if med[False][c] else f"{'-':>15}"
                                 for c in COLUMNS))


if __name__ == "__main__":
    main()
