"""Is the recommendation really better than vLLM's defaults? Measure both again, alternating, with repeats.

Each repeat is a full trial (fresh engine, warm-up, rate search) of the baseline and of the recommended config,
in alternation so that drift on a shared machine hits both alike. Prints each config's throughput at its highest
sustained rate within the study's limit (median and spread) and the gain with its range.

    .venv/bin/python benchmarks/ab_gain.py --study default [--repeats 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import optuna

from optimizer.cli.common import existing_config
from optimizer.search.attrs import AB, BASELINE, RESULT
from optimizer.search.runner import prepare
from optimizer.search.confirmed import recommended
from optimizer.search.score import baseline


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--study", default="default")
    p.add_argument("--studies-dir", default="studies")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    url = f"sqlite:///{Path(args.studies_dir, args.study + '.db').resolve()}"
    config = existing_config(url, args.study)
    study = optuna.load_study(study_name=args.study, storage=url)
    base, best = baseline(study), recommended(study)
    if base is None or best is None:
        raise SystemExit("the study needs a finished baseline and a feasible recommendation")
    if best.number == base.number:
        raise SystemExit("the recommendation is vLLM's defaults: there is nothing to compare")
    # A scratch study in memory, with the same objective as the real one but no early stop.
    scratch = config.model_copy(update={"study_name": f"{args.study}-ab", "storage_url": "sqlite:///:memory:",
                                        "budget": 2 * args.repeats})
    prepared = prepare(scratch, Path(args.studies_dir) / "ab", say=lambda *a: None)
    prepared.objective.early_stop = False
    prepared.objective.records = None
    for _ in range(args.repeats):
        prepared.study.enqueue_trial({}, user_attrs={**BASELINE.item(True), **AB.item("defaults")})
        prepared.study.enqueue_trial(best.params, user_attrs=AB.item("recommended"))
    # the scratch study queues its own baseline first: it runs too, as a warm-up, and is not counted
    prepared.study.optimize(prepared.objective, n_trials=2 * args.repeats + 1)
    got: dict[str, list[float]] = {"defaults": [], "recommended": []}
    for t in prepared.study.trials:
        side = AB.of(t)
        if side is None:
            continue
        r = RESULT.of(t)
        got[side].append(r["output_throughput_tok_s"] if r.get("feasible") else 0.0)
    print(f"study {args.study!r}, TTFT P99 <= {config.ttft_p99_ms:.0f}ms, {args.repeats} alternating repeats each; "
          f"recommended = trial #{best.number}, defaults = trial #{base.number}")
    print(f"{'config':>12}  {'median tok/s':>12}  {'min':>8}  {'max':>8}  {'in the study':>12}")
    for name, trial in (("defaults", base), ("recommended", best)):
        v = np.asarray(got[name])
        print(f"{name:>12}  {np.median(v):>12.1f}  {v.min():>8.1f}  {v.max():>8.1f}  {trial.values[0]:>12.1f}")
    d, r = np.asarray(got["defaults"]), np.asarray(got["recommended"])
    if np.median(d) > 0:
        pairs = [(b / a - 1) * 100 for a, b in zip(d, r) if a > 0]
        print(f"gain: median {np.median(r) / np.median(d) * 100 - 100:+.1f}%, per pair "
              + ", ".join(f"{g:+.1f}%" for g in pairs))


if __name__ == "__main__":
    main()
