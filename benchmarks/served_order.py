"""Do the runs as served rank a pair the other way round for real, or by one run's luck? A finished study's vLLM's
defaults and its recommendation (or `--trial N`), measured again in rounds: each round both configs in process and
both through `vllm serve` (the confirmation's own run: a fresh engine or server, the warm-up, the rate search from the
search trial's bracket, the pooled fit), on a workload draw of its own (the study's seed + 2000 + round: no draw the
study replayed), the order rotated by the round. Reads the study, writes nothing to it.

    flock /tmp/optimizer-engine.lock .venv/bin/python benchmarks/served_order.py studies/default [--rounds 3]

The study's confirmation ran its rounds in process and each config once as served; `decision/served.py::
order_as_served_line` says so when that one run ranks the pair the other way round. Printed: each run's rate at the
limit, per backend the gain of the recommendation over the defaults per round with its 95% interval (the pair's
per-round log ratios: `measurement/intervals.py::block_gain_interval` with two rows), and per config the ratio as
served over in process per round.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna  # noqa: E402

from optimizer.measurement.intervals import block_gain_interval  # noqa: E402
from optimizer.search import confirm  # noqa: E402
from optimizer.search.attrs import CONFIRM  # noqa: E402
from optimizer.search.confirmed import confirmation, run_rate_rps  # noqa: E402
from optimizer.search.runner import prepare  # noqa: E402
from optimizer.search.study import DIRECTIONS  # noqa: E402

OTHER_SEED = 2000  # round r replays the workload of the study's seed + this + r (confirm_claim.py's: + 1000)
BACKENDS = ("in process", "as served")


def gain_text(i) -> str:
    return f"{i.median:+.1%} [{i.low:+.1%}, {i.high:+.1%}]" if i is not None and i.known else "none"


def main() -> None:
    from optimizer.cli.common import existing_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("study", help="DIR/NAME: a finished study with a confirmation (DIR/NAME.db)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--trial", type=int, help="the config to compare with vLLM's defaults (default: the recommended)")
    args = p.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    where = Path(args.study)
    config = existing_config(f"sqlite:///{where.with_name(where.name + '.db').resolve()}", where.name)
    prepared = prepare(config, where.parent, say=lambda *a: None)
    c = confirmation(prepared.study)
    if c is None or c.base is None:
        raise SystemExit(f"{args.study}: no confirmation with vLLM's defaults")
    other = next((x for x in c.configs if x.number == args.trial), None) if args.trial is not None else c.best
    if other is None or other.baseline:
        raise SystemExit("give --trial N: a confirmed config other than vLLM's defaults")
    objective = prepared.objective
    if objective.served_factory is None:
        raise SystemExit(f"{args.study} was run without runs as served (--no-served): no `vllm serve` to start")
    scratch = replace(objective, config=config.model_copy(update={"study_name": f"{config.study_name}-order"}),
                      records=None, logs_dir=objective.logs_dir.with_name(f"{config.study_name}-order.logs"))
    pair = [c.base.trial, other.trial]
    study = optuna.create_study(directions=DIRECTIONS)
    order = []
    for r in range(args.rounds):  # each round's order rotated by the round: no config or backend always first
        block = [(t, served) for served in (False, True) for t in pair]
        shift = r % len(block)
        order += [(r, *x) for x in block[shift:] + block[:shift]]
    for r, t, served in order:
        seed = config.workload.seed + OTHER_SEED + r
        study.enqueue_trial({}, user_attrs=confirm.run_attrs("order", t, r, config.ttft_p99_ms, config.engine_args,
                                                             seed, served=served))
    t0 = time.perf_counter()
    rates: dict[tuple[int, bool], dict[int, float]] = {}
    seen: set[int] = set()
    for _ in order:
        study.optimize(scratch, n_trials=1, gc_after_trial=False)
        t = next(t for t in study.trials if t.state.is_finished() and t.number not in seen)  # the run just ended
        seen.add(t.number)
        a = CONFIRM.of(t)
        rate = run_rate_rps(t)
        rates.setdefault((a["of"], bool(a.get("served"))), {})[a["round"]] = rate
        print(f"  round {a['round'] + 1} #{a['of']} {BACKENDS[bool(a.get('served'))]}: {rate:.2f} req/s at the limit "
              f"[{(t.datetime_complete - t.datetime_start).total_seconds():.0f}s]", flush=True)
    names = {c.base.number: f"#{c.base.number} vLLM's defaults", other.number: f"#{other.number}"}
    said = gain_text(c.gain(other))
    print(f"\n{args.study}: {args.rounds} rounds, {(time.perf_counter() - t0) / 60:.1f} min; the study said: "
          f"in process {said} (#{other.number} over the defaults, {len(c.full_rounds)} rounds); as served, one run "
          f"each: "
          f"{', '.join(f'{names[x.number]} {x.served_rate.rate_rps:.2f}' for x in (c.base, other) if x.served_rate)}")
    print(f"| config | backend | {' | '.join(f'round {r + 1}' for r in range(args.rounds))} | geometric mean |")
    print(f"| --- | --- | {' | '.join('---' for _ in range(args.rounds))} | --- |")
    for served in (False, True):
        for t in pair:
            got = rates.get((t.number, served), {})
            values = [got.get(r, 0.0) for r in range(args.rounds)]
            mean = math.exp(statistics.mean(math.log(v) for v in values)) if all(v > 0 for v in values) else 0.0
            print(f"| {names[t.number]} | {BACKENDS[served]} | {' | '.join(f'{v:.2f}' for v in values)} | {mean:.2f} |")
    for served in (False, True):
        rows = [[rates.get((t.number, served), {}).get(r, 0.0) for r in range(args.rounds)] for t in pair]
        print(f"#{other.number} over the defaults, {BACKENDS[served]}: {gain_text(block_gain_interval(rows, 0, 1))}")
    for t in pair:
        ratios = [rates[(t.number, True)][r] / rates[(t.number, False)][r] for r in range(args.rounds)
                  if rates.get((t.number, False), {}).get(r) and rates.get((t.number, True), {}).get(r)]
        print(f"{names[t.number]}: as served over in process per round {', '.join(f'{v:.2f}' for v in ratios)}")


if __name__ == "__main__":
    main()
