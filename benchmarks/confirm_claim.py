"""Does the reported gain check out? Each study is run as `optimize` runs it (search, then the confirmation); then
vLLM's defaults and the recommendation are measured again on other workload draws (other seeds), each on a fresh
engine, alternating, and the re-measured gain is compared with the interval the study reported.

    .venv/bin/python benchmarks/confirm_claim.py --studies 8              # the simulator with injected noise
    flock /tmp/optimizer-engine.lock .venv/bin/python benchmarks/confirm_claim.py --real 1 --budget 16
    flock /tmp/optimizer-engine.lock .venv/bin/python benchmarks/confirm_claim.py --real-study default
    flock /tmp/optimizer-engine.lock .venv/bin/python benchmarks/confirm_claim.py \
        --real-study studies/default --real 3 --budget 16 --confirm 3 --num-requests 500 --no-served

The reported gain is the confirmation's: the median of its per-round gains of the recommendation over vLLM's
defaults, with its 95% interval, in which every config of the rounds pools its spread (a block design:
optimizer/measurement/intervals.py::block_gain_interval). Beside it, the interval of the same runs from the pair's
per-round ratios alone (`gain_interval`, what the confirmation reported before), and whether that one holds it.
When the confirmation recommends the defaults themselves, their gain is 0 by construction: the check then uses the
best other confirmed config's interval, so that no row passes for free. The re-measurement runs `--remeasure`
rounds of both configs, each round on a workload of its own seed (the study's + 1000 + round; the confirmation's
rounds replay + 1 + round), with the confirmation's own run (bisection to within 3%), and takes the median of its
per-round gains. A row is "inside" when that falls inside the interval.

The re-measurement has noise of its own, so even an interval that is right about its spread misses it at times: its
'chance' is how often (intervals.py::chance_inside, from the study's rounds, its interval's t and degrees of freedom
and the re-measurement's rounds). With 8 rounds reported and 3 re-measured it is about 75%; a re-measurement of
more rounds tells a narrow right interval from a wrong one better. The sum of the rows' chances is the count of rows
inside that intervals right about their spread would give on average. `--chance-of DIR/NAME` prints a stored study's
chance alone (no engine starts).

The same re-measured runs check the rates to provision for (decision/served.py::provision_rps: the one-sided 95%
lower prediction bound of one more run from the rounds' spread): each re-measured run's rate at the limit in process
is counted as held when it is at or above its config's rate to provision for; about 19 in 20 should be.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna  # noqa: E402

from optimizer.config.model import DEFAULT_MODEL_CONFIG, DEFAULT_MODEL_NAME, model_info  # noqa: E402
from optimizer.config.settings import StudyConfig  # noqa: E402
from optimizer.config.workload_spec import CPU_DEMO_WORKLOAD, WorkloadSpec  # noqa: E402
from optimizer.decision.served import provision_rps  # noqa: E402
from optimizer.measurement.intervals import (  # noqa: E402
    Interval, block_gain_df, chance_inside, gain_interval, t_quantile,
)
from optimizer.search import confirm  # noqa: E402
from optimizer.search.attrs import CONFIRM  # noqa: E402
from optimizer.search.objective import Objective  # noqa: E402
from optimizer.search.runner import prepare, run  # noqa: E402
from optimizer.search.confirmed import Confirmation, confirmation, run_rate_rps, run_tok_s  # noqa: E402
from optimizer.search.study import DIRECTIONS, storage_for  # noqa: E402

OTHER_SEED = 1000  # the re-measurement's round r replays the workload of the study's seed + this + r


@dataclass
class Row:
    engine: str
    study: str
    compared: str  # "#N vs defaults"
    reported: Interval  # the study's: every config of the rounds pooled (block_gain_interval)
    paired: Interval  # the same runs, the pair's per-round ratios alone (gain_interval: what it reported before)
    remeasured: float
    minutes: float
    provision_held: int = 0  # re-measured runs whose rate at the limit is at or above their config's to provision for
    provision_runs: int = 0  # re-measured runs of configs with a rate to provision for
    truth: float | None = None  # the simulator's gain without its noise (None: the real engine has no such truth)
    again_rounds: tuple[float, ...] = ()  # the re-measurement's per-round gains (its median is `remeasured`)
    again_interval: Interval | None = None  # their own t interval: the re-measurement's noise, beside the report's
    chance: float = math.nan  # how often an interval right about its spread holds a re-measurement of these rounds

    @property
    def inside(self) -> bool:
        return self.reported.contains(self.remeasured)

    @property
    def inside_paired(self) -> bool:
        return self.paired.contains(self.remeasured)

    @property
    def truth_inside(self) -> bool | None:
        return None if self.truth is None else self.reported.contains(self.truth)


def checked_config(c: Confirmation) -> Any:
    """The confirmed config whose gain is checked: the recommendation, or the best other one when the defaults won."""
    best = c.best
    if best is not None and not best.baseline:
        return best
    others = [x for x in c.configs if not x.baseline]
    return max(others, key=lambda x: c.interval(x).median, default=None)


def reported_chance(c: Confirmation, chosen: Any, reported: Interval, again: int) -> tuple[float, int, float]:
    """The t and degrees of freedom of `reported` (`chosen`'s gain over the defaults), and the chance that it holds
    the median of `again` re-measured rounds were it right about its spread (intervals.py::chance_inside)."""
    df = block_gain_df(c.difference_rows(chosen, c.base), 0, 1)
    if df < 1:
        return math.nan, df, math.nan
    t = t_quantile(c.confidence, df)
    return t, df, chance_inside(t, df, reported.n, again)


def remeasure(objective: Objective, config: StudyConfig, pair: list[optuna.trial.FrozenTrial],
              rounds: int) -> tuple[list[tuple[float, float]], dict[int, list[float]]]:
    """Both configs again on other workload draws (round r: seed + OTHER_SEED + r, never a draw the confirmation
    replayed), alternating, each run on a fresh engine: the per-round (defaults, other) values, and each config's
    rates at the limit in process, by trial number. A run's value is its pooled fit's throughput, as the rounds' (a
    run stored before has none: its goodput)."""
    scratch_config = config.model_copy(update={"study_name": f"{config.study_name}-again"})
    scratch = replace(objective, config=scratch_config, records=None,  # its logs beside the study's, not over them
                      logs_dir=objective.logs_dir.with_name(f"{config.study_name}-again.logs"))
    study = optuna.create_study(directions=DIRECTIONS)
    limit = config.ttft_p99_ms
    for r in range(rounds):
        for t in (pair if r % 2 == 0 else pair[::-1]):
            seed = config.workload.seed + OTHER_SEED + r
            study.enqueue_trial({}, user_attrs=confirm.run_attrs("again", t, r, limit, config.engine_args, seed))
    study.optimize(scratch, n_trials=2 * rounds, gc_after_trial=False)
    got: dict[int, dict[int, float]] = {}
    rates: dict[int, list[float]] = {}
    for t in study.trials:
        c = CONFIRM.of(t)
        got.setdefault(c["of"], {})[c["round"]] = run_tok_s(t)  # as the study's rounds value a run
        rates.setdefault(c["of"], []).append(run_rate_rps(t))
    base, other = pair[0].number, pair[1].number
    return [(got[base][r], got[other][r]) for r in range(rounds)], rates


def check(study: optuna.Study, prepared: Any, engine: str, rounds: int, minutes: float,
          truth_factory: Any = None, truth_draws: int = 0) -> Row | None:
    """The study's reported gain against the pair re-measured on other draws; on the simulator (`truth_factory`, an
    engine factory without noise) also against the pair's gain without noise, the geometric mean of `truth_draws`
    draws' gains: what the interval is meant to cover (the re-measurement has noise of its own)."""
    c = confirmation(study)
    if c is None or not c.usable or c.base is None:
        print(f"  {study.study_name}: no usable confirmation (no feasible trial?): skipped", flush=True)
        return None
    chosen = checked_config(c)
    if chosen is None:
        return None
    reported = c.gain(chosen)
    assert reported is not None
    paired = gain_interval([(a, b) for r in c.full_rounds if (a := c.base.value_tok_s(r)) is not None
                            and (b := chosen.value_tok_s(r)) is not None], confidence=c.confidence)
    pairs, rates = remeasure(prepared.objective, prepared.config, [c.base.trial, chosen.trial], rounds)
    again = gain_interval(pairs)
    label = f"#{chosen.number} vs defaults" + (" (defaults won)" if c.best is c.base else "")
    floors = {x.number: p for x in (c.base, chosen) if (p := provision_rps(c, x)) is not None}
    held = [(rate, floors[n]) for n, got in rates.items() if n in floors for rate in got]
    truth = None
    if truth_factory is not None:  # the same pair on the simulator without noise: its gain over `truth_draws` draws
        quiet = replace(prepared.objective, engine_factory=truth_factory)
        exact, _ = remeasure(quiet, prepared.config, [c.base.trial, chosen.trial], truth_draws)
        truth = math.exp(statistics.mean(math.log(b / a) for a, b in exact if a > 0 and b > 0)) - 1
    return Row(engine, study.study_name, label, reported, paired, again.median, minutes,
               sum(rate >= floor for rate, floor in held), len(held), truth,
               tuple(b / a - 1 for a, b in pairs if a > 0), again,
               reported_chance(c, chosen, reported, again.n)[2] if again.n >= 1 else math.nan)


def stored_chances(names: list[str], again: int) -> None:
    """Each stored study's reported gain and the chance that it holds a re-measurement of `again` rounds, were it
    right about its spread: nothing is measured."""
    total = []
    for name in names:
        where = Path(name)
        db = where.with_name(where.name + ".db")
        if not db.is_file():
            print(f"{name}: no study database {db}")
            continue
        study = optuna.load_study(study_name=where.name, storage=storage_for(f"sqlite:///{db.resolve()}"))
        c = confirmation(study)
        chosen = None if c is None or not c.usable or c.base is None else checked_config(c)
        if chosen is None or (reported := c.gain(chosen)) is None:
            print(f"{name}: no gain to check (no usable confirmation, or the defaults alone)")
            continue
        t, df, chance = reported_chance(c, chosen, reported, again)
        if not math.isnan(chance):  # no degree of freedom: no interval to hold anything
            total.append(chance)
        print(f"{name:<40} #{chosen.number} vs defaults {reported.median * 100:>+6.1f}% {bounds_pct(reported):<20} "
              f"{reported.n} rounds, {c.confidence:.4f}: t {t:.3f} on {df} df; chance {chance:.0%} "
              f"({again} rounds re-measured)")
    print(f"{len(total)} studies: intervals right about their spread would hold about {sum(total):.1f} of their "
          f"re-measurements ({again} rounds each)")


def sim_rows(args: argparse.Namespace) -> list[Row]:
    from optimizer.engines.sim.noise import SHARED_CPU, NoiseSource
    from optimizer.engines.sim.steptime import StepTimeModel
    from optimizer.engines.simulated import SimulatedEngine

    info = model_info(DEFAULT_MODEL_CONFIG, "sim")
    rows = []
    for k in range(args.studies):
        seed = args.first_seed + k
        source = NoiseSource(replace(SHARED_CPU, seed=seed, run_cv=args.noise_run_cv))
        engines: list[SimulatedEngine] = []

        def factory() -> SimulatedEngine:
            engine = SimulatedEngine(info, StepTimeModel(), "cpu", noise=source)
            engines.append(engine)
            return engine

        d = Path(tempfile.mkdtemp(prefix="confirm-claim-"))
        config = StudyConfig(study_name=f"sim-{seed}", storage_url=f"sqlite:///{d}/s.db", ttft_p99_ms=args.ttft_p99_ms,
                             budget=args.budget, confirm=args.confirm, seed=seed, model=DEFAULT_MODEL_NAME,
                             model_is_default=True, device="cpu", workload=WorkloadSpec(**CPU_DEMO_WORKLOAD),
                             engine_args={"enforce_eager": True})
        prepared = prepare(config, d, say=lambda *a: None, engine_factory=factory, memory_probe=lambda: None)
        study = run(prepared, quiet=True, say=lambda *a: None)
        minutes = sum(e.virtual_s for e in engines) / 60
        row = check(study, prepared, "simulator + noise", args.remeasure, minutes,
                    lambda: SimulatedEngine(info, StepTimeModel(), "cpu"), args.truth_draws)
        if row is not None:
            rows.append(row)
            print(f"  {fmt(row)}", flush=True)
    return rows


def real_rows(args: argparse.Namespace) -> list[Row]:
    from optimizer.cli.common import existing_config

    rows = []
    names = list(args.real_study or [])
    d = Path(args.studies_dir)
    for k in range(args.real):
        name = f"claim-{args.first_seed + k}"
        t0 = time.perf_counter()
        from optimizer.cli.main import main as optimize

        code = optimize(["--ttft-p99", f"{args.ttft_p99_ms:g}ms", "--budget", str(args.budget), "--study", name,
                         "--studies-dir", str(d), "--seed", str(args.first_seed + k), "--model", args.model,
                         "--quiet", *(["--confirm", str(args.confirm)] if args.confirm is not None else []),
                         *(["--num-requests", str(args.num_requests)] if args.num_requests else []),
                         *(["--no-served"] if args.no_served else [])])
        if code != 0:
            print(f"  {name}: optimize exited {code}: skipped", flush=True)
            continue
        names.append(name)
        print(f"  {name}: study with confirmation {(time.perf_counter() - t0) / 60:.1f} min", flush=True)
    for name in names:
        where, label = d / name, name
        if "/" in name:  # DIR/NAME: a study in another studies dir
            where = Path(name)
            label = f"{where.parent.parent.name}/{where.name}"
        url = f"sqlite:///{where.with_name(where.name + '.db').resolve()}"
        config = existing_config(url, where.name)
        t0 = time.perf_counter()
        prepared = prepare(config, where.parent, say=lambda *a: None)
        row = check(prepared.study, prepared, "real CPU engine", args.remeasure, 0.0)
        if row is not None:
            row.study = label
            row.minutes = (time.perf_counter() - t0) / 60
            rows.append(row)
            print(f"  {fmt(row)}", flush=True)
    return rows


def fmt(row: Row) -> str:
    return (f"{row.engine:<18} {row.study:<12} {row.compared:<28} {row.reported.median * 100:>+7.1f}% "
            f"{bounds_pct(row.reported):<20} {row.remeasured * 100:>+7.1f}%  {'yes' if row.inside else 'NO':<6} "
            f"{row.chance:>6.0%} "
            f"{bounds_pct(row.paired):<20} {'yes' if row.inside_paired else 'NO':<6} "
            f"{f'{row.provision_held}/{row.provision_runs}':>9} {row.minutes:>6.1f}"
            + ("" if row.truth is None else f"  {row.truth * 100:>+7.1f}%  {'yes' if row.truth_inside else 'NO'}"))


def bounds_pct(i: Interval) -> str:
    return f"[{i.low * 100:+.1f}%, {i.high * 100:+.1f}%]" if i.known else "(no interval)"


def half_width_pct(i: Interval) -> float:
    return (i.high - i.low) * 50 if i.known else math.inf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--studies", type=int, default=0, help="simulated studies (with injected noise)")
    p.add_argument("--real", type=int, default=0, help="studies on the real CPU engine")
    p.add_argument("--real-study", action="append",
                   help="an existing real study to check: NAME (in --studies-dir) or DIR/NAME (in DIR)")
    p.add_argument("--studies-dir", default="studies")
    p.add_argument("--model", default="tiny-llama-4m", help="the embedded shape of --real studies")
    p.add_argument("--budget", type=int, default=40)
    p.add_argument("--confirm", type=int, default=None, help="the studies' --confirm (default: optimize's)")
    p.add_argument("--remeasure", type=int, default=3, help="rounds of the re-measurement")
    p.add_argument("--chance-of", action="append", metavar="DIR/NAME",
                   help="a stored study: print the chance that its interval holds a re-measurement of --remeasure "
                        "rounds, and measure nothing")
    p.add_argument("--truth-draws", type=int, default=6,
                   help="on the simulator, draws of the pair measured without noise: the gain the interval should hold")
    p.add_argument("--num-requests", type=int, default=None,
                   help="the --real studies' probe cap (default: the embedded demo's; the demo's probe chose 500 on "
                        "the 2-core EPYC)")
    p.add_argument("--no-served", action="store_true",
                   help="the --real studies skip the runs through `vllm serve` (the checked gain is the rounds')")
    p.add_argument("--ttft-p99-ms", type=float, default=150.0)
    p.add_argument("--first-seed", type=int, default=1)
    p.add_argument("--noise-run-cv", type=float, default=None,
                   help="the simulator's per-engine step-time sigma (default: SHARED_CPU's; a confirmation run on the "
                        "real engine, on one draw, varies by 4-8%%)")
    args = p.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.chance_of:
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        stored_chances(args.chance_of, args.remeasure)
        return
    from optimizer.engines.sim.noise import SHARED_CPU
    if args.noise_run_cv is None:
        args.noise_run_cv = SHARED_CPU.run_cv
    t0 = time.perf_counter()
    rows = sim_rows(args) + real_rows(args)
    head = (f"{'engine':<18} {'study':<12} {'compared':<28} {'reported gain, 95% interval':<29}  "
            f"{'again':>7}  {'inside':<6} {'chance':>6} {'the pair alone (before)':<20} {'inside':<6} "
            f"{'provision':>9} {'min':>6}  {'truth':>8}  inside")
    print()
    print(f"TTFT P99 <= {args.ttft_p99_ms:g} ms; the study's confirmed gain against the gain measured again on other "
          f"workload seeds ({args.remeasure} alternating rounds on fresh engines, a draw each); 'min': engine minutes "
          f"of the study (simulated) or wall minutes of the re-measurement (real); 'provision': re-measured runs "
          f"at or above their config's rate to provision for; 'truth' (simulator): the pair's gain without noise")
    print(head)
    print("-" * len(head))
    for row in rows:
        print(fmt(row))
    chances = [r.chance for r in rows if not math.isnan(r.chance)]
    print(f"reported: {sum(r.inside for r in rows)} of {len(rows)} inside; intervals right about their spread would "
          f"hold about {sum(chances):.1f} of {len(chances)} ('chance': the re-measurement's own noise)")
    for name, inside, widths in (("reported (every config of the rounds pooled)", [r.inside for r in rows],
                                  [half_width_pct(r.reported) for r in rows]),
                                 ("the pair alone (before)", [r.inside_paired for r in rows],
                                  [half_width_pct(r.paired) for r in rows])):
        print(f"{name}: {sum(inside)} of {len(rows)} inside; half-width median "
              f"{statistics.median(widths) if widths else math.nan:.1f} points")
    for row in rows:  # the re-measurement has noise of its own: a narrow report can miss a noisy re-measurement
        if row.again_rounds and row.again_interval is not None:
            print(f"{row.study}: re-measured per round {', '.join(f'{g * 100:+.1f}%' for g in row.again_rounds)}; "
                  f"their own 95% interval {bounds_pct(row.again_interval)}")
            if len(row.again_rounds) > 3:  # as the rows of 3 rounds read it
                first = statistics.median(row.again_rounds[:3])
                print(f"  its first 3 rounds' median {first * 100:+.1f}%: "
                      f"{'inside' if row.reported.contains(first) else 'outside'}")
    truths = [r.truth_inside for r in rows if r.truth is not None]
    if truths:
        print(f"simulator, against the gain without noise ({args.truth_draws} draws): {sum(truths)} of {len(truths)} "
              f"inside the reported interval")
    held, runs = sum(r.provision_held for r in rows), sum(r.provision_runs for r in rows)
    print(f"rate to provision for: {held} of {runs} re-measured runs at or above it"
          + (f" ({held / runs:.0%}; aim: 95%)" if runs else ""))
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
