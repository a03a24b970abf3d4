"""Precision per minute, before and after probes sized by evidence (issue 20): vLLM's defaults measured as whole
trials by this tree's code and by an earlier commit's, alternating, in one run on one machine.

    .venv/bin/python benchmarks/precision_per_minute.py --sim [--runs 20]
    flock /tmp/optimizer-engine.lock .venv/bin/python benchmarks/precision_per_minute.py [--runs 4] [--before c661c2f]

"Before" is `--before` (default c661c2f, the last commit with fixed-length replays: 120 requests each on the
embedded demo, a burst's pace as the search's ceiling, the sustained ratio); "after" is this tree. Each arm runs
in a process of its own, importing its own tree's `optimizer` (the earlier commit is unpacked with `git archive`),
set up as `optimize --ttft-p99 150ms` sets up the embedded demo (its own probe of the machine chooses the shape and
the replay length), and first runs the study's baseline trial once as a warm-up, not counted. Then the arms take
turns (before, after, after, before, ...): each turn is one trial of vLLM's defaults on a fresh engine, the study's
own objective, early stop off.

Printed per arm: each trial's rate at the limit (after: the pooled fit's rate; before: the highest rate that
passed), its minutes (the trial's wall time: engine start, replays, shutdown; on the simulator its modelled
seconds), and two half-widths, each times the square root of the median minutes (precision per minute: lower is
better; doubling the minutes of a sqrt-n estimate leaves it unchanged):
- the spread: 1.96 x the standard deviation of log rate over the arm's trials, how far one trial's number lands
  from the arm's centre, measured the same way for both arms;
- the trial's own 95% interval, median half-width (after only: before, a trial had none).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
MARK = "PPM "  # a child's answer lines; anything else on its stdout is a library's


def serve(tree: Path, sim: bool, seed: int) -> None:
    """One arm: set up the demo study with `tree`'s code, run its baseline as a warm-up, then one trial of vLLM's
    defaults per line read on stdin, each answered with a MARK line."""
    sys.path.insert(0, str(tree))
    import optuna

    import optimizer
    from optimizer.cli.run import build_parser, resolve_config
    from optimizer.search.attrs import BASELINE, RESULT, RUN
    from optimizer.search.runner import prepare

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    engines: list[Any] = []
    factory = None
    if sim:
        from dataclasses import replace

        from optimizer.config.model import DEFAULT_MODEL_CONFIG, model_info
        from optimizer.engines.sim.noise import SHARED_CPU, NoiseSource
        from optimizer.engines.sim.steptime import StepTimeModel
        from optimizer.engines.simulated import SimulatedEngine

        info = model_info(DEFAULT_MODEL_CONFIG, "sim")
        source = NoiseSource(replace(SHARED_CPU, seed=seed))

        def factory() -> Any:
            engines.append(SimulatedEngine(info, StepTimeModel(), "cpu", noise=source))
            return engines[-1]

    d = Path(tempfile.mkdtemp(prefix="ppm-"))
    ns = build_parser().parse_args(["--study", "ppm", "--ttft-p99", "150ms", "--budget", "100", "--studies-dir",
                                    str(d), "--seed", str(seed)])
    config, _ = resolve_config(ns)
    prepared = prepare(config, d, say=lambda *a: None, engine_factory=factory)
    prepared.objective.early_stop = False
    prepared.objective.records = None
    prepared.study.optimize(prepared.objective, n_trials=1)  # the queued baseline: a warm-up, not counted
    config = prepared.config
    print(MARK + json.dumps({"model": config.model, "num_requests": config.workload.num_requests,
                             "code": str(Path(optimizer.__file__).parents[1])}), flush=True)
    for _ in sys.stdin:
        modelled = sum(e.virtual_s for e in engines)
        prepared.study.enqueue_trial({}, user_attrs={**RUN.item(True), **BASELINE.item(True)})
        prepared.study.optimize(prepared.objective, n_trials=1)
        t = prepared.study.trials[-1]
        r = RESULT.of(t)
        fit = r.get("rate_at_limit") or {}
        wall_s = (t.datetime_complete - t.datetime_start).total_seconds()
        print(MARK + json.dumps({
            "rate_rps": fit.get("rate_rps", r.get("rate_rps")), "low_rps": fit.get("low_rps"),
            "high_rps": fit.get("high_rps"), "feasible": bool(r.get("feasible")),
            "minutes": (sum(e.virtual_s for e in engines) - modelled if sim else wall_s) / 60,
        }), flush=True)


def answer(out: IO[str]) -> dict[str, Any]:
    for line in out:
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise SystemExit("an arm ended without answering: see its stderr log")


def half_width_pct(low: float, high: float | None) -> float:
    """An interval's half-width in percent, in log terms (the mean of its two sides); inf for an open one."""
    return math.inf if high is None else 50 * (math.log(high) - math.log(low))


def summary(name: str, shape: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    rates = [r["rate_rps"] for r in runs if r["rate_rps"]]
    minutes = statistics.median(r["minutes"] for r in runs)
    logs = [math.log(x) for x in rates]
    spread = 196 * statistics.stdev(logs) if len(logs) > 1 else math.nan  # percent
    own = [half_width_pct(r["low_rps"], r["high_rps"]) for r in runs if r.get("low_rps")]
    own_hw = statistics.median(own) if own else math.nan
    root = math.sqrt(minutes)
    each = ", ".join(f"{x:.2f}" if x else "none" for x in (r["rate_rps"] for r in runs))
    return (f"{name:<7} {shape['model']:<15} {shape['num_requests']:>5}  {statistics.median(rates):>7.2f}  "
            f"{spread:>6.1f}%  {own_hw:>6.1f}%  {minutes:>6.2f}  {spread * root / 100:>8.3f}  "
            f"{own_hw * root / 100:>8.3f}   {each}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="c661c2f", help="the commit measured as 'before' (default c661c2f)")
    p.add_argument("--runs", type=int, default=4, help="counted trials per arm (default 4)")
    p.add_argument("--sim", action="store_true", help="on the simulated engine with the shared-CPU noise")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--serve", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        return serve(Path(args.serve), args.sim, args.seed)
    t0 = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="ppm-trees-"))
    before = scratch / "before"
    before.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
    arms: dict[str, tuple[subprocess.Popen[str], dict[str, Any]]] = {}
    for name, tree in (("before", before), ("after", ROOT)):  # one at a time: each probes the machine
        cmd = [sys.executable, __file__, "--serve", str(tree), "--seed", str(args.seed),
               *(["--sim"] if args.sim else [])]
        child = subprocess.Popen(cmd, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=open(scratch / f"{name}.log", "w"), text=True)
        assert child.stdout is not None
        arms[name] = (child, answer(child.stdout))
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for i in range(args.runs):
        for name in (("before", "after") if i % 2 == 0 else ("after", "before")):
            child, _ = arms[name]
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write("run\n")
            child.stdin.flush()
            runs[name].append(answer(child.stdout))
            r = runs[name][-1]
            print(f"  {name:<6} run {i}: {r['rate_rps'] or 0:.2f} req/s in {r['minutes']:.2f} min", flush=True)
    for child, _ in arms.values():
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    engine = "the simulator with the shared-CPU noise (modelled minutes)" if args.sim else "the real CPU engine"
    print(f"\nvLLM's defaults, TTFT P99 <= 150 ms, {args.runs} trials per arm alternating on {engine}; before = "
          f"{args.before}, after = this tree; {(time.perf_counter() - t0) / 60:.1f} min in all (logs: {scratch})")
    print(f"{'arm':<7} {'model':<15} {'cap':>5}  {'median':>7}  {'spread':>7}  {'own':>7}  {'min':>6}  "
          f"{'spread*':>8}  {'own*':>8}   rates (req/s)")
    for name, (_, shape) in arms.items():
        print(summary(name, shape, runs[name]))
    for name, (_, shape) in arms.items():
        print(f"{name}: code from {shape['code']}")
    print("spread: 1.96 x sd of log rate over the trials; own: the trial's 95% interval, median half-width; "
          "min: median minutes a trial; *: x sqrt(min), the precision per minute (lower is better)")


if __name__ == "__main__":
    main()
