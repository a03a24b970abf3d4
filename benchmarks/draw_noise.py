"""How much of a confirmation run's spread is the machine, and how much the draw of requests? One config of an existing
study (vLLM's defaults unless `--trial N`) is measured as the confirmation measures it (a fresh engine, the warm-up,
the rate at the limit bisected to within 3%), `--runs` times on one workload draw and `--runs` times on a new draw
each, alternating, and the coefficient of variation of each group is printed.

    flock /tmp/optimizer-engine.lock .venv/bin/python benchmarks/draw_noise.py --study claim-11 --studies-dir /tmp/claim

The same draw varies by the machine alone; new draws add the sample of requests. The confirmation's rounds replay a
new draw each (optimizer/search/confirm.py::round_seed), so its interval covers both: where the draw dominates, more
requests per replay (`--num-requests`) narrow it, more rounds barely do.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna  # noqa: E402

from optimizer.measurement.noise import coefficient_of_variation  # noqa: E402
from optimizer.search import confirm  # noqa: E402
from optimizer.search.attrs import CONFIRM, RESULT  # noqa: E402
from optimizer.search.score import baseline, goodput  # noqa: E402
from optimizer.search.study import DIRECTIONS  # noqa: E402

DRAWS_FROM = 2000  # the new draws' seeds: the study's workload seed + this + k; the same draw: + this


def main() -> None:
    from optimizer.cli.common import existing_config
    from optimizer.search.runner import prepare

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--study", required=True)
    p.add_argument("--studies-dir", default="studies")
    p.add_argument("--trial", type=int, default=None, help="the config to measure (default: vLLM's defaults)")
    p.add_argument("--runs", type=int, default=4, help="runs per group")
    p.add_argument("--prior-rps", type=float, default=None,
                   help="start each run's search here, as a later round starts at its config's rate so far")
    args = p.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    d = Path(args.studies_dir)
    config = existing_config(f"sqlite:///{(d / f'{args.study}.db').resolve()}", args.study)
    prepared = prepare(config, d, say=lambda *a: None)
    chosen = (baseline(prepared.study) if args.trial is None else
              next((t for t in prepared.study.trials if t.number == args.trial), None))
    if chosen is None:
        p.exit(2, f"draw_noise: study {args.study!r} has no trial #{args.trial} (or no baseline): pass --trial N\n")
    scratch = replace(prepared.objective, config=config.model_copy(update={"study_name": f"{args.study}-draws"}),
                      records=None, logs_dir=prepared.objective.logs_dir.with_name(f"{args.study}-draws.logs"))
    study = optuna.create_study(directions=DIRECTIONS)
    seed0 = config.workload.seed + DRAWS_FROM
    for k in range(args.runs):
        for group, seed in (("same", seed0), ("new", seed0 + 1 + k)):
            study.enqueue_trial({}, user_attrs=confirm.run_attrs(group, chosen, k, config.ttft_p99_ms,
                                                                 config.engine_args, seed,
                                                                 prior_rps=[args.prior_rps] if args.prior_rps else ()))
    t0 = time.perf_counter()
    study.optimize(scratch, n_trials=2 * args.runs, gc_after_trial=False)
    groups: dict[str, list[float]] = {"same": [], "new": []}
    rates: dict[str, list[float]] = {"same": [], "new": []}
    for t in study.trials:
        groups[CONFIRM.of(t)["plan"]].append(goodput(t))
        rates[CONFIRM.of(t)["plan"]].append(float((RESULT.of(t).get("rate_at_limit") or {}).get("rate_rps") or 0.0))
    print(f"trial #{chosen.number} of {args.study}, {config.workload.num_requests} requests per replay, "
          f"{args.runs} runs a group, alternating ({time.perf_counter() - t0:.0f} s)")
    for name, label in (("same", "one draw (the machine alone)"), ("new", "a new draw each run")):
        v = groups[name]
        print(f"  {label:<30} CV {coefficient_of_variation(v) * 100:5.1f}%   tok/s: {', '.join(f'{x:.0f}' for x in v)}")
        r = rates[name]
        print(f"  {'':<30} CV {coefficient_of_variation(r) * 100:5.1f}%   rate at the limit, req/s: "
              f"{', '.join(f'{x:.1f}' for x in r)}")


if __name__ == "__main__":
    main()
