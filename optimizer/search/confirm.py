"""The confirmation: after the search, vLLM's defaults and the top candidates measured again, alternating, each on a
fresh engine, in rounds until they decide (at most `--confirm N` rounds; by default as many as 65% of the budget
holds with the runs as served, up to 8, and more of the configs left when one drops out).

One whole trial of one config varies by 12-18% on a shared machine, mostly by the rung of the rate ladder it lands
on: a study's "+18.7% over vLLM's defaults" was, measured again, no gain at all. So the number a user acts on is
measured again:

- the candidates are vLLM's defaults (where they met the limit in the search: else there is no gain to decide, and
  the rounds stop at the first look), the search's recommendation and its closest rival whose rate interval (its
  pooled fit) overlaps the recommendation's (where the recommendation has none, measured by fixed-length replays:
  whose bracket, widened by the study's noise);
- each run is a trial of its own (a fresh engine, the warm-up, then `search_rate` from its trial's bracket, or from the
  second round on from its config's rate so far, `prior_spec`: probes sized by evidence until the rate passed and the
  rate failed are within 3% whatever its fit says, measurement/rate_search.py::RUN_FIT_BRACKET), stored with a
  `confirm` attribute in the study's confirmation study NAME.confirmation (search/study.py `confirmation_study`), so
  that an interrupted confirmation resumes where it stopped, as trials do, and Optuna's own tools (`best_trials`,
  optuna-dashboard) see in NAME only the search's trials. Run 3 of it is named c3 (`run_name`: `optimize report
  --trial c3`, its engine log confirm-00003.log);
- the rounds alternate the order of the configs (round 2 starts with the second), so a slow minute of the
  machine hits each alike, and a round's runs of two configs are taken next to each other: the gain is measured
  per round (optimizer/measurement/intervals.py);
- each round replays a workload drawn anew from the study's spec (seed + 1 + round, `round_seed`), the same draw for
  every config of the round: the interval then covers which requests came as well as the machine's noise, and no
  round replays the draw the search chose its winner on (a winner is partly the luck of that draw);
- after every round from the second on, the rounds look at their gain intervals (measurement/sequential.py, the 5%
  error spent over the looks the plan allows, group-sequentially, most of it kept for the last) and stop once they
  decide: the recommendation's gain over vLLM's defaults lies below 0 or within +-3 points, or above 0 and within
  +-5 points (`PRECISE_HALF_WIDTH`, stored in the plan; above 0 but wider, the planned rounds go on); a candidate
  clearly behind the leader drops out of the later rounds; the next round is queued only when the one before has
  finished; a run's number is its pooled fit's throughput at the limit (search/confirmed.py::run_tok_s);
- the recommendation is the config with the highest median over its rounds (search/confirmed.py::recommended);
- then, unless the study runs `vllm serve` throughout (`--backend http`) or `--no-served`, vLLM's defaults and the
  leader run once more each through `vllm serve` over HTTP (the objective's `served_factory`), on a draw no round
  replayed: a user deploys the server, and on a small machine the server, the engine and the client share its cores,
  so the rate as served can lie well below the rate in process. The report shows both, each named.

The runs come out of the user's budget (search/split.py): `--budget 40` is 14 search trials, up to 24 runs (8 rounds
of 3 configs, or 12 of 2 where no rival overlaps; rounds that decide early leave the rest unspent) and 2 served;
`--confirm N` asks for up to N rounds whatever the budget. With a deadline (`--budget 8h`), the search stops early
enough for the rounds, and a round that would end past the deadline is not started.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer.config.limits import Limits
from optimizer.measurement.disturbance import disturbance_text, disturbed
from optimizer.measurement.rate_search import BRACKET_STEP
from optimizer.measurement.sequential import GROUP_SEQUENTIAL, PRECISE_HALF_WIDTH, SPENDING_POWER, Outcome
from optimizer.search.attrs import (
    CONFIRM, ENGINE_PARAMS, MACHINE_LOAD, PRUNED_REASON, STUDY_CONFIRMATION, TIMINGS,
)
from optimizer.search.confirmed import (DISTURBED_TRIES, FIT_VALUE, SPREAD_ALL_RUNS, Confirmation, Confirmed,
                                        confirmation)
from optimizer.search.measured import measurement_of
from optimizer.search.missed import why_infeasible
from optimizer.search.placement import gpus_text
from optimizer.search.score import (
    baseline, noise_cv, rank_trials, rate_at_limit_text, scored_best_first, study_limits,
    tied_with,
)
from optimizer.search.split import CONFIGS, SPLIT_RULE, rounds_after_drop, rounds_for
from optimizer.search.budget import wait_while_running
from optimizer.search.study import confirmation_runs, confirmation_study, is_baseline, run_name, search_trials

ROUND_SEED_STEP = 1  # round r replays the workload of seed + ROUND_SEED_STEP + r
RUN_OVER_TRIAL = 1.3  # a confirmation run against a median search trial: its bisection replays more
# A run after its config's first round starts PRIOR_SPAN under its rates' median, first steps up as far over, then by
# PRIOR_STEP (5.9%: one bisection takes a crossing within 3%); from the search trial's bracket, a third of later runs
# failed at the start.
PRIOR_SPAN = 1.029
PRIOR_STEP = PRIOR_SPAN ** 2


def interval_of(trial: FrozenTrial) -> tuple[float, float] | None:
    """The trial's rate at the limits as its 95% interval (TrialMeasurement.rate_interval_rps)."""
    m = measurement_of(trial)
    return None if m is None else m.rate_interval_rps


def candidates(study: optuna.Study) -> list[FrozenTrial]:
    """vLLM's defaults (when they met the limit in the search: rounds of a config that meets it nowhere give no gain
    to decide, and would run to the end undecided), the recommendation of the search and its closest rival: the
    highest-scored other trial whose rate interval (its pooled fit) overlaps the recommendation's, or where the
    recommendation has none (fixed-length replays), whose bracket does. At most CONFIGS; none when no trial meets the
    limit."""
    scored = scored_best_first(study)
    if not scored:
        return []
    trials = search_trials(study)
    cv = noise_cv(trials)
    best_trial, best_ranked = scored[0]
    mine = interval_of(best_trial)
    if mine is not None:
        rivals = [t.number for t, _ in scored[1:] if (iv := interval_of(t)) is not None
                  and iv[0] <= mine[1] and mine[0] <= iv[1]]
    else:
        rivals = tied_with(best_ranked, {t.number: r for t, r in scored[1:]}, cv)
    base = baseline(study)
    met = base is not None and base.state == TrialState.COMPLETE and any(t.number == base.number for t, _ in scored)
    out = [base] if met else []
    for t, _ in scored:
        if len(out) >= CONFIGS:
            break
        if t not in out and (t is best_trial or t.number in rivals):
            out.append(t)
    return out


def run_spec(trial: FrozenTrial, limits: Limits | float, engine_args: dict[str, Any]) -> dict[str, Any]:
    """Where a candidate's run starts its bisection: the rate its search trial passed (inf: a burst met the limit)
    and the rate it failed; for a trial that met the limit nowhere, the lowest rate it tried."""
    ranked = rank_trials([trial], engine_args, limits)[trial.number]
    if ranked.answerable:
        start = math.inf if ranked.rate_rps is None else float(ranked.rate_rps)
        return {"start_rps": start, "failed_rps": ranked.next_rate_rps}
    m = measurement_of(trial)
    rates = [p["offered_rate_rps"] for p in (m.curve if m is not None else ()) if p.get("offered_rate_rps")]
    return {"start_rps": min(rates) if rates else math.inf, "failed_rps": None}


def round_seed(workload_seed: int, round_: int) -> int:
    """Pure: the workload seed of confirmation round `round_` (0-based) of a study whose workload has `workload_seed`:
    never the search's own draw, and one draw per round, shared by the round's configs."""
    return workload_seed + ROUND_SEED_STEP + round_


def enqueue(study: optuna.Study, rounds: int, engine_args: dict[str, Any],
            workload_seed: int | None = None, served: bool = False, asked: bool = True) -> dict[str, Any] | None:
    """Plan the confirmation of the finished search (once: a plan for the same search trials is kept; asked for more
    rounds than it has by a rerun's `--confirm N` (`asked`), it may run up to those; a default's rounds grow a plan
    made by the same SPLIT_RULE, as after a deadline, and keep one made under another) and queue what it needs next:
    the runs of the last round that are missing (an interrupted run is run again), else the next round, unless the
    rounds have decided or ran out (`Confirmation.outcome`). A config clearly behind the leader drops out before the
    next round (`Confirmation.behind`). Each round's order is rotated by one and each round replays its own workload
    draw (`round_seed`; None: the search's own workload). With `served`, once the rounds are over, vLLM's defaults and
    the leader run once more each through `vllm serve` (`Confirmation.served_missing`), on one draw no round replayed.
    Returns the plan (None: nothing to confirm)."""
    key = plan_key(study)
    stored = STUDY_CONFIRMATION.of(study)
    if stored and stored.get("plan") == key:
        kept = int(stored.get("rounds", rounds))  # a default's rounds grow only within the rule the plan was made by
        raised = rounds if asked else rounds_for(rounds, len(stored.get("candidates") or [])) \
            if stored.get("split") == SPLIT_RULE else kept
        plan_attr = {**stored, "rounds": max(raised, kept)}
        if asked:  # the user's --confirm N: its rounds, whatever a drop-out leaves
            plan_attr.pop("split", None)
        if plan_attr["rounds"] > kept:  # the looks taken keep what they spent ...
            done = len(confirmation(study, stored).full_rounds)
            if 0 < done < kept:  # ... unless the plan ran out: the rounds a rerun adds then look afresh
                plan_attr["grown"] = [*stored.get("grown", []), [done, kept]]
        # a plan made without runs as served (--no-served) gets none on a resume: its budget had none
        plan_attr["served"] = served and bool(stored.get("served"))
    else:
        chosen = candidates(study)
        if not chosen:
            return None
        # without vLLM's defaults (they met the limit nowhere) there is no gain to decide: the first look ends it
        compared = len(chosen) if any(is_baseline(t) for t in chosen) else 1
        plan_attr = {"plan": key, "rounds": rounds if asked else rounds_for(rounds, compared),
                     "candidates": [t.number for t in chosen], **({} if asked else {"split": SPLIT_RULE}),
                     "limits": study_limits(study).model_dump(mode="json"), "spending": SPENDING_POWER, "looks": GROUP_SEQUENTIAL,
                     "value": FIT_VALUE, "dropped": {}, "served": served, "precise_half_width": PRECISE_HALF_WIDTH,
                     "spread": SPREAD_ALL_RUNS}
    c = confirmation(study, plan_attr)
    assert c is not None
    runs, dropping = next_runs(c)
    if dropping:
        plan_attr["dropped"] = {**plan_attr.get("dropped", {}), **{str(n): r for n, r in dropping.items()}}
        if plan_attr.get("split") == SPLIT_RULE and runs:  # a default plan: what they leave goes to more rounds
            done, planned = runs[0][1], int(plan_attr["rounds"])
            grown = rounds_after_drop(planned, done, len(runs) + len(dropping), len(runs))
            if grown > planned:  # the looks so far keep the error they spent (sequential.py::spent)
                plan_attr["grown"] = [*plan_attr.get("grown", []), [done, planned]]
                plan_attr["rounds"] = grown
    STUDY_CONFIRMATION.set(study, plan_attr)
    home = confirmation_study(study, create=True)
    assert home is not None
    for x, r in runs:
        seed = None if workload_seed is None else round_seed(workload_seed, r)
        prior = [x.rate_rps(k) or 0.0 for k in sorted(x.runs) if k < r]
        home.enqueue_trial({}, user_attrs=run_attrs(key, x.trial, r, plan_limits(plan_attr), engine_args, seed,
                                                    prior_rps=prior), skip_if_exists=False)
    if not runs:
        seed = None if workload_seed is None else round_seed(workload_seed, c.rounds)  # a draw no round replays
        for x in c.served_missing:
            home.enqueue_trial({}, user_attrs=run_attrs(key, x.trial, c.rounds, plan_limits(plan_attr), engine_args,
                                                        seed, served=True), skip_if_exists=False)
    return plan_attr


def plan_key(study: optuna.Study) -> str:
    """The key of a plan: the search trials it confirms (their count and the last one's number)."""
    finished = sorted(t.number for t in search_trials(study))
    return f"{len(finished)}:{finished[-1] if finished else -1}"


def next_runs(c: Confirmation) -> tuple[list[tuple[Confirmed, int]], dict[int, int]]:
    """What the confirmation runs next, as (config, round) in the order to run them: the runs of its latest
    round still missing (an interrupted run), else the next round's, its order rotated by the round, else none when
    the rounds decided or ran out. With the next round come the configs that drop out at it (number -> round):
    those clearly behind the leader."""
    last = c.rounds_started[-1] if c.rounds_started else -1
    missing = [x for x in c.configs if c.measured_in(x, last) and last not in x.runs] if last >= 0 else []
    if missing:
        return [(x, last) for x in missing], {}
    if c.outcome != Outcome.RUNNING or last + 1 >= c.rounds:
        return [], {}
    r = last + 1
    dropping = {x.number: r for x in c.behind()}
    order = [x for x in c.configs if c.measured_in(x, r) and x.number not in dropping]
    return [(order[(k + r) % len(order)], r) for k in range(len(order))], dropping


def prior_spec(rates_rps: Sequence[float]) -> dict[str, float] | None:
    """Pure: where a run starts after earlier rounds put its config at `rates_rps` (rates at the limit; 0 or inf:
    nothing there): PRIOR_SPAN under their median, its first step up PRIOR_SPAN over, then steps of PRIOR_STEP. None
    when no rate is known."""
    known = [r for r in rates_rps if 0 < r < math.inf]
    if not known:
        return None
    median_rps = statistics.median(known)
    return {"start_rps": median_rps / PRIOR_SPAN, "failed_rps": median_rps * PRIOR_SPAN, "step": PRIOR_STEP}


def plan_limits(plan_attr: dict[str, Any]) -> Limits:
    """The limits a confirmation plan ranks its candidates at."""
    return Limits.model_validate(plan_attr["limits"])


def run_attrs(plan_key: str, trial: FrozenTrial, round_: int, limits: Limits | float, engine_args: dict[str, Any],
              workload_seed: int | None = None, served: bool = False,
              prior_rps: Sequence[float] = ()) -> dict[str, Any]:
    """The user attributes of one queued run of `trial`: its engine arguments, where its bisection starts (from its
    earlier rounds' rates `prior_rps` when there are any, `prior_spec`; else its search trial's bracket, `run_spec`;
    JSON has no infinity, so a burst start is stored as None), the seed of the workload it replays (None: the
    study's) and, for a run through `vllm serve` (`served`), `served: true` (the objective starts a server for it)."""
    spec = prior_spec(prior_rps) or {k: (None if isinstance(v, float) and math.isinf(v) else v)
                                     for k, v in run_spec(trial, limits, engine_args).items()}
    return CONFIRM.item({"plan": plan_key, "of": trial.number, "round": round_, "params": ENGINE_PARAMS.of(trial),
                         "workload_seed": workload_seed, **spec, **({"served": True} if served else {})})


def start_rates(confirm: dict[str, Any]) -> tuple[float, float | None, float]:
    """A run's stored starting rate (None: a burst), failed rate and step, as `search_rate` takes them (a run that
    starts from its search trial's bracket, `run_spec`, has no step: BRACKET_STEP's)."""
    start = confirm.get("start_rps")
    return (math.inf if start is None else float(start)), confirm.get("failed_rps"), \
        float(confirm.get("step", BRACKET_STEP))


def run_estimate_s(study: optuna.Study) -> float | None:
    """How long one confirmation run takes: the median of the runs so far, else RUN_OVER_TRIAL x the median search
    trial; None before any trial finished."""
    complete = (TrialState.COMPLETE,)
    runs = [TIMINGS.of(t)["total_s"] for t in confirmation_runs(study, complete) if TIMINGS.of(t).get("total_s")]
    if runs:
        return float(statistics.median(runs))
    trials = [TIMINGS.of(t)["total_s"] for t in search_trials(study, complete) if TIMINGS.of(t).get("total_s")]
    return RUN_OVER_TRIAL * float(statistics.median(trials)) if trials else None


def rounds_in_time(rounds: int, deadline_unix_s: float | None, run_s: float | None,
                   now_unix_s: float | None = None, done: int = 0) -> int:
    """Pure but for the clock: how many of `rounds` fit before the deadline at `run_s` a run (all without one), the
    `done` rounds a resumed plan has already run counted in (they take no more time); 0 when no new round fits."""
    if deadline_unix_s is None or run_s is None or run_s <= 0:
        return rounds
    left_s = deadline_unix_s - (time.time() if now_unix_s is None else now_unix_s)
    fit = int(max(left_s, 0.0) // (CONFIGS * run_s))
    return min(rounds, done + fit) if fit else 0


def waiting(study: optuna.Study) -> list[FrozenTrial]:
    """The runs queued in `study`'s confirmation study, oldest first."""
    home = confirmation_study(study)
    return [] if home is None else home.get_trials(deepcopy=False, states=(TrialState.WAITING,))


def run(study: optuna.Study, objective: Callable[[optuna.Trial], Any], rounds: int, engine_args: dict[str, Any],
        say: Callable[..., None], on_run: Callable[[optuna.Study, FrozenTrial], None] | None = None,
        deadline_unix_s: float | None = None, now_unix_s: Callable[[], float] = time.time,
        workload_seed: int | None = None, served: bool = False, asked: bool = True) -> str:
    """Plan the confirmation (once) and run its rounds until they decide or run out (`enqueue` queues each round
    when the one before has finished; `asked`: the rounds are the user's `--confirm N`, not the default), then, with
    `served`, the runs through `vllm serve`, in the study's confirmation study; says when a config drops out. Returns
    a line when it stopped short (else '')."""
    if rounds <= 0:
        return ""
    said = []

    def on_wait() -> None:
        if not said:
            said.append(True)
            say("confirmation: waiting for the other workers' trials to finish")

    for s in (study, confirmation_study(study)):  # another worker's search trial, or its confirmation run
        if s is not None:
            wait_while_running(s, timeout_s=3600.0, on_wait=on_wait)
    key, planned = plan_key(study), False
    callbacks = [lambda s, t: on_run(s, t)] if on_run else []
    while True:
        pending = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        if pending:
            return (f"confirmation: not run: {len(pending)} trials queued before it (the pre-screen's?) still wait: "
                    f"run again with a larger --budget to measure them first")
        queue = waiting(study)
        if not queue:
            stored = STUDY_CONFIRMATION.of(study) or {}
            before, grown_before = stored.get("dropped") or {}, len(stored.get("grown") or ())
            plan_attr = enqueue(study, rounds, engine_args, workload_seed, served, asked)
            if plan_attr is None:
                return "" if planned else "confirmation: nothing to confirm: no trial meets the limit"
            planned = True
            for number, r in (plan_attr.get("dropped") or {}).items():
                if number not in before:
                    grew = len(plan_attr.get("grown") or ()) > grown_before
                    more = int(plan_attr["rounds"]) - int(plan_attr["grown"][-1][1]) if grew else 0
                    say(f"confirmation: trial #{number} drops out after round {r}: clearly behind the leader"
                        + (f"; its runs go to {more} more round{'s' if more > 1 else ''} of the others (up to "
                           f"{plan_attr['rounds']})"
                           if more > 0 else ""))
            queue = waiting(study)
            if not queue:
                return ""
        home = confirmation_study(study)  # a run is queued: it exists
        assert home is not None
        head = CONFIRM.of(queue[0]) or {}
        if head.get("plan") != key:  # an older plan's run, never started: skip it
            _drop(home, queue[0])
            continue
        if deadline_unix_s is not None:
            left_s, est = deadline_unix_s - now_unix_s(), run_estimate_s(study)
            if est is not None and est > left_s:
                return (f"confirmation: stopped at the deadline: the next run takes ~{est:.0f} s and {left_s:.0f} s "
                        f"are left; fewer rounds are reported")
        home.optimize(objective, n_trials=1, callbacks=callbacks, catch=(), gc_after_trial=True)


def _drop(study: optuna.Study, trial: FrozenTrial) -> None:
    """End a queued run unrun (FAIL, never queued again): one of an older plan."""
    try:
        study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
    except optuna.exceptions.UpdateFinishedTrialError:
        pass


def describe(trial: FrozenTrial) -> str:
    """One line for a finished run: which config, which round, its rate bracket and throughput."""
    c = CONFIRM.of(trial) or {}
    m = measurement_of(trial)
    seed = f", workload seed {c['workload_seed']}" if c.get("workload_seed") is not None else ""
    what = "as served (`vllm serve` over HTTP)" if c.get("served") else \
        f"confirmation round {int(c.get('round', 0)) + 1}"
    head = f"{what}, trial #{c.get('of')} again (run {run_name(trial)}{seed})"
    if trial.state != TrialState.COMPLETE or m is None:
        return f"{head}: could not run ({PRUNED_REASON.of(trial) or trial.state.name})"
    load = MACHINE_LOAD.of(trial)
    note = (f"; disturbed ({disturbance_text(load)}): not counted unless its round's {DISTURBED_TRIES} tries all are"
            if disturbed(load) else "")
    took = f"[{TIMINGS.of(trial).get('total_s', 0):.0f}s{gpus_text(trial)}]"
    if not m.feasible:
        return f"{head}: {why_infeasible(m)} {took}{note}"
    bound = m.bound_text
    return (f"{head}: {rate_at_limit_text(m)}; {m.output_throughput_tok_s:.1f} tok/s {took}{note}"
            + (f"; limited by {bound}" if bound else ""))
