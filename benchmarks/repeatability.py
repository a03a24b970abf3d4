"""How repeatable is one trial's number? The same config measured as several whole trials, each on a fresh engine.

Each run is what a study does for one trial (engine start, warm-up, rate search, then `--repeats` replays at the
best rate), with the study's objective code. Prints each run's goodput (output tok/s at the highest sustained rate
within the limit), the coefficient of variation across runs (the noise between trials, which a study's
comparisons face) and within runs (replays at one rate on one engine, what `--repeats` measures).

    .venv/bin/python benchmarks/repeatability.py [--runs 3] [--repeats 3] [--ttft-p99 150ms] [--params JSON]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

from optimizer.cli.run import build_parser, resolve_config
from optimizer.measurement.noise import coefficient_of_variation, median
from optimizer.measurement.rerank import merge_repeats
from optimizer.search.attrs import BASELINE, RUN
from optimizer.search.measured import measurement_of
from optimizer.search.runner import prepare


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="whole trials of the same config (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="replays at each run's best rate (default 3)")
    p.add_argument("--ttft-p99", default="150ms")
    p.add_argument("--params", default="{}", help="engine params as JSON (default: vLLM's defaults, the baseline)")
    p.add_argument("--sim", action="store_true", help="on the simulated engine (deterministic: CV 0, a check)")
    args = p.parse_args()
    params = json.loads(args.params)
    with tempfile.TemporaryDirectory() as d:
        ns = build_parser().parse_args(["--study", "repeatability", "--ttft-p99", args.ttft_p99, "--budget",
                                        str(args.runs + 1), "--studies-dir", d])
        config, _ = resolve_config(ns)
        config = config.model_copy(update={"repeats": args.repeats})
        factory = None
        if args.sim:
            from optimizer.engines.simulated import SimulatedEngine
            from optimizer.config.model import DEFAULT_MODEL_CONFIG, model_info

            info = model_info(DEFAULT_MODEL_CONFIG, "sim")
            factory = lambda: SimulatedEngine(info)  # noqa: E731
        prepared = prepare(config, Path(d), say=lambda *a: None, engine_factory=factory)
        prepared.objective.early_stop = False  # every run does its whole rate search
        prepared.objective.records = None
        for _ in range(args.runs):
            queued = {**RUN.item(True), **(BASELINE.item(True) if not params else {})}
            prepared.study.enqueue_trial(params, user_attrs=queued)
        t0 = time.perf_counter()
        # the study's own baseline is queued first and runs as a warm-up of the machine; it is not counted
        prepared.study.optimize(prepared.objective, n_trials=args.runs + 1)
        minutes = (time.perf_counter() - t0) / 60
        runs = [t for t in prepared.study.trials if RUN.of(t)]
    print(f"config {params or 'vLLM defaults'}; TTFT P99 <= {args.ttft_p99}; {args.runs} runs on fresh engines, "
          f"{args.repeats} replays at each run's best rate; {minutes:.1f} min")
    print(f"{'run':>4}  {'rate req/s':>10}  {'goodput tok/s':>13}  {'replays at best rate (tok/s)':>30}  {'CV within':>9}")
    goodputs, within = [], []
    for i, t in enumerate(runs):
        m = measurement_of(t)
        met = m is not None and m.feasible
        good = t.values[0] if met else 0.0
        goodputs.append(good)
        rate = m.rate_rps if m is not None else None
        curve = list(m.curve) if m is not None else []
        at_best = [pt["output_throughput_tok_s"] for pt in curve if met and pt["offered_rate_rps"] == rate]
        merged = [pt for pt in merge_repeats(curve) if pt["offered_rate_rps"] == rate]
        cv = merged[0].get("output_throughput_cv", math.nan) if merged else math.nan
        within.append(cv)
        rate_s = "burst" if rate is None else f"{rate:.2f}"
        print(f"{i:>4}  {rate_s:>10}  {good:>13.1f}  {' '.join(f'{v:.1f}' for v in at_best):>30}  {cv:>9.1%}")
    across = coefficient_of_variation(goodputs)
    print(f"goodput: median {median(goodputs):.1f} tok/s, CV across runs {across:.1%}; median CV within a run "
          f"{median([c for c in within if not math.isnan(c)]):.1%}")


if __name__ == "__main__":
    main()
