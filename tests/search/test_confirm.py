"""The confirmation (search/confirm.py) on the simulated engine: planned into the budget, alternating rounds on fresh
engines, resumed after an interruption, and the recommendation chosen from its numbers."""

import json
import math

import optuna
import pytest
from optuna.trial import TrialState

from optimizer.config.limits import Limits
from optimizer.core.errors import UsageError
from optimizer.decision.decide import decide
from optimizer.decision.report import summary_text
from optimizer.decision.document import render
from optimizer.config.settings import RateSearchSpec
from optimizer.measurement.rate_search import BRACKET_PRECISION
from optimizer.search import confirm, split
from optimizer.search.attrs import (
    BASELINE, CONFIRM, CURVE, ENGINE_PARAMS, LOG_FILE, MACHINE_LOAD, RESULT, RETRY_OF, STUDY_CONFIRMATION,
)
from optimizer.search.incumbent import fair_incumbent_rate, single_run_lower_rps
from optimizer.search.measured import SCHEMA
from optimizer.search.objective import Objective
from optimizer.search.runner import prepare, run
from optimizer.search.confirmed import confirmation, recommended
from optimizer.search.score import feasible
from optimizer.search.records import RecordStore
from optimizer.search.study import (
    confirmation_runs, confirmation_study, confirmation_study_name, finished_count, is_confirmation,
)
from tests.support.fakes import SimEngine, make_config, run_study


def test_plan_takes_the_runs_out_of_the_budget():
    p = split.plan(40, None)
    assert (p.rounds, p.search_budget, p.runs) == (8, 16, 24) and "16 search trials" in p.line
    assert split.plan(24, None).rounds == 5  # 65% of 24 is 15 runs: 5 rounds of 3
    assert split.plan(100, None).rounds == split.MAX_AUTO_ROUNDS == 8  # 65 runs would be 21 rounds
    small = split.plan(9, None)  # 65% is 5 runs: fewer than 2 rounds, so none, and it says how to get them
    assert (small.rounds, small.search_budget) == (0, 9) and "--budget 10" in small.line
    # the 2 runs as served count in the share: 12 holds 7 runs, 2 served and 1 round; 13 holds 2 rounds
    served = split.plan(12, None, served=True)
    assert served.rounds == 0 and "--budget 13" in served.line
    assert (split.plan(13, None, served=True).rounds, split.plan(13, None, served=True).search_budget) == (2, 5)
    assert split.plan(20, 3).search_budget == 11  # asked for: taken whatever the share
    assert split.plan(40, 0) == split.Plan(0, 40, "confirmation: off (--confirm 0)")
    assert split.plan(None, None).search_budget is None  # a deadline alone: the time is planned instead
    with pytest.raises(UsageError, match="--budget 11 or more"):
        split.plan(10, 3)


def test_rounds_that_fit_before_a_deadline():
    assert confirm.rounds_in_time(3, None, 50.0) == 3
    assert confirm.rounds_in_time(3, 1000.0, 50.0, now_unix_s=700.0) == 2  # 300 s: 2 rounds of 3 runs of 50 s
    assert confirm.rounds_in_time(3, 1000.0, 50.0, now_unix_s=900.0) == 0
    # a resumed plan of 8 rounds done, asked for 9 with a new deadline 300 s away: its 8 take no more time
    assert confirm.rounds_in_time(9, 1000.0, 50.0, now_unix_s=700.0, done=8) == 9
    assert confirm.rounds_in_time(9, 1000.0, 50.0, now_unix_s=900.0, done=8) == 0  # no new round fits


@pytest.fixture
def confirmed(tmp_path, config_only_model):
    config = make_config(tmp_path, config_only_model, budget=12, confirm=2)
    return config, run_study(tmp_path, config)


def test_rounds_alternate_on_fresh_engines_after_the_search(confirmed):
    config, study = confirmed
    runs = confirmation_study(study).trials  # in the study NAME.confirmation, not among the search's trials
    search = study.trials
    assert not any(is_confirmation(t) for t in search) and all(is_confirmation(t) for t in runs)
    assert finished_count(study) == len(search) == 12 - 2 * split.CONFIGS
    assert min(t.datetime_start for t in runs) > max(t.datetime_complete for t in search)  # after the search
    assert [t.number for t in confirmation_runs(study)] == [t.number for t in runs]
    plan = STUDY_CONFIRMATION.of(study)
    chosen = plan["candidates"]
    assert plan["rounds"] == 2 and chosen[0] == 0 and 2 <= len(chosen) <= split.CONFIGS  # the defaults first
    assert plan["looks"] == "group-sequential" and plan["value"] == "rate-at-limit"  # a new plan's rules
    order = [(CONFIRM.of(t)["round"], CONFIRM.of(t)["of"]) for t in runs]
    assert order == [(0, n) for n in chosen] + [(1, n) for n in chosen[1:] + chosen[:1]]  # round 2 rotated by one
    assert all(t.state == TrialState.COMPLETE for t in runs)
    for t in runs:  # each run bisected the rate at the limit to within 3% whatever its fit said, or ran out of probes
        r = RESULT.of(t)
        assert r["feasible"] and (r["failed_rate_rps"] / r["rate_rps"] <= 1 + BRACKET_PRECISION + 1e-6
                                  or len(CURVE.of(t)) == RateSearchSpec().max_replays)
    # round 2 starts from round 1's rate at the limit, just under it and stepping finely; round 1 from the search
    first = {CONFIRM.of(t)["of"]: RESULT.of(t)["rate_at_limit"]["rate_rps"] for t in runs
             if CONFIRM.of(t)["round"] == 0}
    for t in runs:
        c = CONFIRM.of(t)
        if c["round"] == 0:
            assert "step" not in c
        else:
            assert c["start_rps"] == pytest.approx(first[c["of"]] / confirm.PRIOR_SPAN)
            assert c["failed_rps"] == pytest.approx(first[c["of"]] * confirm.PRIOR_SPAN)
            assert c["step"] == confirm.PRIOR_STEP and CURVE.of(t)[0]["offered_rate_rps"] == pytest.approx(
                c["start_rps"])
    # their numbers start at 0 again: their engine logs and request records never take a search trial's
    logs = [LOG_FILE.of(t) for t in (*search, *runs)]
    assert len(set(logs)) == len(logs) and all(log.endswith(f"confirm-{t.number:05d}.log") for log, t in
                                               zip(logs[len(search):], runs))
    store = RecordStore(config.storage_url)
    try:
        mine = [store.load(confirmation_study_name(config.study_name), t.number) for t in runs]
        searched = [store.load(config.study_name, t.number) for t in search]
    finally:
        store.close()
    # each holds its own replays, one per point of its curve: none of a run added to the search trial of its number
    assert [len(r) for r in mine + searched] == [len(CURVE.of(t)) for t in (*runs, *search)]
    assert all(mine) and all(searched)


def test_optunas_best_trials_are_search_trials_and_report_reaches_a_run_by_its_name(confirmed, tmp_path, capsys):
    from optimizer.cli.main import main

    config, _ = confirmed
    study = optuna.load_study(study_name=config.study_name, storage=config.storage_url)  # as Optuna's tools see it
    front = study.best_trials
    # the search's trials alone: sampled parameters, or vLLM's defaults; never a run with params {}
    assert front and all(not is_confirmation(t) and (t.params or BASELINE.of(t)) for t in front)
    top = max((t for t in study.trials if t.state == TrialState.COMPLETE and feasible(t)), key=lambda t: t.values[0])
    assert top.number in {t.number for t in front}  # the search's highest throughput within the limit leads it
    runs = optuna.load_study(study_name=f"{config.study_name}.confirmation", storage=config.storage_url).trials
    run = runs[-1]
    line = confirm.describe(run)
    assert f"(run c{run.number}, " in line  # the name the console gives it ...
    rc = main(["report", "--study", config.study_name, "--storage", config.storage_url, "--trial", f"c{run.number}",
               "--studies-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and out.splitlines()[0] == line  # ... is the name the report takes
    assert out.splitlines()[1].startswith(f"it measured trial #{CONFIRM.of(run)['of']}")
    rc = main(["report", "--study", config.study_name, "--storage", config.storage_url, "--trial",
               f"c{len(runs) + 5}", "--studies-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and f"has no confirmation run c{len(runs) + 5}" in err and "confirmation runs: c0, c1, " in err


def test_a_run_after_the_first_round_starts_at_its_configs_median_rate_so_far():
    spec = confirm.prior_spec([70.0, 0.0, 74.0, math.inf, 71.0])  # 0: met the limit nowhere; inf: a burst
    assert spec["start_rps"] == pytest.approx(71.0 / 1.029) and spec["failed_rps"] == pytest.approx(71.0 * 1.029)
    # passed and failed within 6% once it crossed: one bisection takes them within 3% (RUN_FIT_BRACKET)
    assert spec["failed_rps"] / spec["start_rps"] == pytest.approx(spec["step"])
    assert math.sqrt(spec["step"]) <= 1 + BRACKET_PRECISION
    assert confirm.prior_spec([]) is None and confirm.prior_spec([0.0, math.inf]) is None
    assert confirm.start_rates({"start_rps": 70.0, "failed_rps": 72.0}) == (70.0, 72.0, 1.25)  # a run queued before
    assert confirm.start_rates({"start_rps": None, "failed_rps": None}) == (math.inf, None, 1.25)


def test_a_default_plan_of_two_configs_spends_the_same_runs_on_more_rounds(monkeypatch):
    assert split.rounds_for(8, 3) == 8 and split.rounds_for(8, 2) == 12 and split.rounds_for(2, 2) == 3
    # vLLM's defaults alone: nothing to compare, the rounds stop after the first look (not "2 of 12")
    assert split.rounds_for(8, 1) == 2
    assert "up to 8 rounds of 3 configs (or 12 of 2)" in split.plan(40, None, served=True).line
    study = _rounds_study({}, rounds=8)
    STUDY_CONFIRMATION.set(study, {})  # no plan yet; the search found vLLM's defaults and one config to confirm
    monkeypatch.setattr(confirm, "candidates", lambda s: s.trials[:2])
    monkeypatch.setattr(confirm, "run_spec", lambda *a: {"start_rps": 10.0, "failed_rps": None})
    monkeypatch.setattr(confirm, "study_limits", lambda s: Limits.ttft_p99(150.0))  # a study optimize made stores it
    assert confirm.enqueue(study, 8, {}, asked=False)["rounds"] == 12  # the default: 24 runs, in rounds of 2
    assert [CONFIRM.of(t)["of"] for t in confirm.waiting(study)] == [0, 1]  # the first round's
    assert STUDY_CONFIRMATION.of(study)["split"] == split.SPLIT_RULE
    STUDY_CONFIRMATION.set(study, {})
    assert confirm.enqueue(study, 8, {}, asked=True)["rounds"] == 8  # --confirm 8: 8 rounds, whatever the configs


def test_the_command_that_adds_a_round_keeps_the_search_whatever_the_plans_rounds():
    # 8 rounds of 3 at --budget 40 (14 search trials, 2 served): one more is 3 more trials; 12 rounds of 2 were
    # charged as 8 of 3, and 13 rounds are charged as 13 of 3, so the budget rises to keep the 14 trials
    three = split.more_rounds_command("s", 40, 8, search_budget=14, served=2)
    two = split.more_rounds_command("s", 40, 12, search_budget=14, served=2)
    assert three == "optimize --study s --budget 43 --confirm 9"
    assert two == "optimize --study s --budget 55 --confirm 13"
    assert split.plan(43, 9, served=True).search_budget == split.plan(55, 13, served=True).search_budget == 14
    assert split.more_rounds_command("s", None, 5) == "optimize --study s --confirm 6"  # a deadline alone
    # a resume keeps the study's deadline, which has passed: the command gives a new one, 3 runs of 50 s and the
    # 2 served (250 s, 5 min) and a minute; with a trial budget too, both
    assert split.more_rounds_command("s", None, 5, served=2, run_s=50.0) == \
        "optimize --study s --budget 6min --confirm 6"
    assert split.more_rounds_command("s", 40, 8, search_budget=14, served=2, run_s=50.0) == \
        "optimize --study s --budget 43 --budget 6min --confirm 9"


def test_round_seeds_are_new_draws_one_per_round():
    assert [confirm.round_seed(7, r) for r in range(3)] == [8, 9, 10]  # never the search's own 7


class PromptLog(SimEngine):
    """The simulator, noting which measured prompts each engine was sent (the first token ids tell draws apart)."""

    sent: list[list[tuple[int, ...]]] = []

    def __init__(self):
        super().__init__()
        PromptLog.sent.append([])

    def simulate_replay(self, requests, arrivals_s):
        PromptLog.sent[-1].extend(r.prompt_token_ids[:8] for r in requests)
        return super().simulate_replay(requests, arrivals_s)


def test_each_round_replays_its_own_draw_the_same_for_every_config(tmp_path, config_only_model):
    config = make_config(tmp_path, config_only_model, budget=10, confirm=2)
    PromptLog.sent = []
    study = run_study(tmp_path, config, engine=PromptLog)
    prepared = prepare(config, tmp_path, say=lambda *a: None, engine_factory=SimEngine, memory_probe=lambda: None)
    study_draw = {r.prompt_token_ids[:8] for r in prepared.objective.workload.requests}
    by_round: dict[int, set] = {}
    runs = confirmation_study(study).trials
    assert len(PromptLog.sent) == len(study.trials) + len(runs)  # one engine each, one at a time
    for k, t in enumerate([*study.trials, *runs]):  # engine k served the k-th trial: the search's, then the runs
        sent = set(PromptLog.sent[k])
        c = CONFIRM.of(t)
        if c is None:
            assert sent <= study_draw | {r.prompt_token_ids[:8] for r in prepared.objective.workload.warmup}
            continue
        assert c["workload_seed"] == confirm.round_seed(config.workload.seed, c["round"])
        measured = sent - {r.prompt_token_ids[:8] for r in prepared.objective.workload.warmup}
        assert measured and not measured & study_draw  # not the draw the search picked its winner on
        by_round.setdefault(c["round"], measured)
        assert measured == by_round[c["round"]]  # every config of a round replays the same requests
    assert len(by_round) == 2 and not by_round[0] & by_round[1]


def test_the_recommendation_and_the_gain_come_from_the_confirmed_numbers(confirmed):
    config, study = confirmed
    c = confirmation(study)
    assert c is not None and c.complete and c.full_rounds == [0, 1]
    assert c.interval(c.best).median == max(c.interval(x).median for x in c.configs)
    # the recommendation is the best, or vLLM's defaults when the rounds decided no candidate beats them (+-3 points)
    assert c.recommended is (c.base if c.outcome.value == "keep" else c.best)
    assert recommended(study).number == c.recommended.number
    d = decide(study, config)
    assert d.confirmed and d.best.number == c.recommended.number
    if c.recommended is not c.base:  # the ratio of the two medians shown (the per-round ratios give its interval)
        assert d.gain_pct == pytest.approx((c.interval(c.best).median / c.interval(c.base).median - 1) * 100)
    text = summary_text(study, config)
    assert "confirmed in 2 rounds" in text and "95% interval" in text and f"#{c.recommended.number}" in text
    out, _ = render(d, "table")  # optimize report shows them too
    assert "confirmed in 2 rounds" in out
    # another limit re-ranks the search's curves: the confirmation measured the study's own limit only
    assert not decide(study, config, Limits.ttft_p99(config.limits.first.value_ms * 2)).confirmed


def test_report_of_a_confirmed_trial_lists_its_runs(confirmed, tmp_path, capsys):
    from optimizer.cli.main import main

    config, study = confirmed
    c = confirmation(study)
    rc = main(["report", "--study", config.study_name, "--storage", config.storage_url, "--trial",
               str(c.best.number), "--studies-dir", str(tmp_path)])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("confirmation round")]
    assert rc == 0 and len(lines) == 2  # its two rounds, each with its run, draw and bracket
    for r, line in enumerate(lines):
        run_no = c.best.runs[r].number
        seed = confirm.round_seed(config.workload.seed, r)
        assert line.startswith(f"confirmation round {r + 1}, trial #{c.best.number} again (run c{run_no}, "
                               f"workload seed {seed}): ") and "req/s at the limit [" in line and "tok/s" in line


def test_an_interrupted_confirmation_resumes_without_running_anything_twice(tmp_path, config_only_model):
    config = make_config(tmp_path, config_only_model, budget=12, confirm=2)
    prepared = prepare(config, tmp_path, say=lambda *a: None, engine_factory=SimEngine, memory_probe=lambda: None)
    calls = {"runs": 0}
    real = Objective.run

    async def stop_at_the_third_run(self, trial):
        if CONFIRM.of(trial) is not None:
            calls["runs"] += 1
            if calls["runs"] == 3:
                raise KeyboardInterrupt
        return await real(self, trial)

    Objective.run = stop_at_the_third_run
    try:
        with pytest.raises(KeyboardInterrupt):
            run(prepared, quiet=True)
    finally:
        Objective.run = real
    study = prepared.study
    assert not confirmation(study).complete
    stopped = [t for t in confirmation_study(study).trials if t.state == TrialState.FAIL]
    assert [t.number for t in stopped] == [2]
    with pytest.warns(UserWarning, match="confirmation runs c2 queued again"):
        again = prepare(config, tmp_path, say=lambda *a: None, engine_factory=SimEngine, memory_probe=lambda: None)
    queued = confirmation_study(study).get_trials(states=(TrialState.WAITING,))
    assert [(RETRY_OF.of(t), CONFIRM.of(t)) for t in queued] == [(2, CONFIRM.of(stopped[0]))]  # run again as one
    study = run(again, quiet=True)
    c = confirmation(study)
    assert c.complete
    done = [(CONFIRM.of(t)["of"], CONFIRM.of(t)["round"]) for t in confirmation_runs(study, (TrialState.COMPLETE,))]
    assert len(done) == len(set(done)) == 2 * len(c.configs)  # every slot once
    assert finished_count(study) == 6 and not any(is_confirmation(t) for t in study.trials)  # no search trial more


def test_a_rerun_with_more_rounds_adds_them_to_the_finished_plan(tmp_path, config_only_model):
    first = make_config(tmp_path, config_only_model, budget=12, confirm=2)
    run_study(tmp_path, first)
    # the same search (6 trials), a third round: --budget 15 --confirm 3
    study = run_study(tmp_path, first.model_copy(update={"budget": 15, "confirm": 3}))
    assert finished_count(study) == 6  # the search was not extended
    plan, c = STUDY_CONFIRMATION.of(study), confirmation(study)
    assert plan["rounds"] == 3 and c.complete and c.full_rounds == [0, 1, 2]
    runs = confirmation_runs(study, (TrialState.COMPLETE,))
    slots = [(CONFIRM.of(t)["round"], CONFIRM.of(t)["of"]) for t in runs]
    assert len(slots) == len(set(slots)) == 3 * len(plan["candidates"])  # the first two rounds not run again
    chosen = plan["candidates"]
    assert [n for r, n in slots if r == 2] == chosen[2:] + chosen[:2]  # the new round rotated by two
    seeds = {CONFIRM.of(t)["round"]: CONFIRM.of(t)["workload_seed"] for t in runs}
    assert seeds == {r: confirm.round_seed(first.workload.seed, r) for r in range(3)}  # its own draw
    again = run_study(tmp_path, first.model_copy(update={"budget": 15, "confirm": 3}))
    assert len(confirmation_study(again).trials) == len(runs)  # asked again: no more


def test_no_confirmation_on_a_small_budget_leaves_the_study_as_before(tmp_path, config_only_model):
    study = run_study(tmp_path, make_config(tmp_path, config_only_model))  # 3 trials: no room for rounds
    assert not any(is_confirmation(t) for t in study.trials) and STUDY_CONFIRMATION.of(study) is None
    assert confirmation_study(study) is None


def test_the_incumbent_is_its_lower_bound_not_its_luckiest_measurement():
    assert single_run_lower_rps(10.0) == pytest.approx(10.0 * (1 - 1.645 * 0.06))
    assert single_run_lower_rps(10.0, replays=4) == pytest.approx(10.0 * (1 - 1.645 * 0.03))
    study = optuna.create_study(directions=["maximize", "minimize"])

    def add(rate, confirm_of=None, feasible=True):
        attrs = {RESULT.key: {"schema": SCHEMA, "feasible": feasible, "rate_rps": rate}}
        if confirm_of is not None:  # a confirmation run, in the confirmation study
            attrs[CONFIRM.key] = {"plan": "p", "of": confirm_of, "round": 0}
        home = study if confirm_of is None else confirmation_study(study, create=True)
        home.add_trial(optuna.trial.create_trial(values=[1.0, 1.0], user_attrs=attrs))

    assert fair_incumbent_rate(study) is None
    add(10.0)  # #0, measured once
    add(12.0, feasible=False)  # #1: a miss is no incumbent
    assert fair_incumbent_rate(study) == pytest.approx(single_run_lower_rps(10.0))
    add(11.0)  # #2: a lucky 11 req/s ...
    for rate in (9.0, 9.5, 9.2):  # ... that the confirmation measured at ~9.2 again
        add(rate, confirm_of=2)
    low = 9.233 - 4.303 * 0.2517 / math.sqrt(3)
    assert fair_incumbent_rate(study) == pytest.approx(max(low, single_run_lower_rps(10.0)), abs=1e-3)
    # a trial measured while other processes took 0.8 of a core is no incumbent, however high it came out
    busy = {"available": True, "others_cores": 0.8, "steal_cores": 0.0, "idle_cores": 0.0}
    study.add_trial(optuna.trial.create_trial(values=[1.0, 1.0], user_attrs={
        RESULT.key: {"schema": SCHEMA, "feasible": True, "rate_rps": 50.0}, MACHINE_LOAD.key: busy}))
    assert fair_incumbent_rate(study) == pytest.approx(max(low, single_run_lower_rps(10.0)), abs=1e-3)
    study.add_trial(optuna.trial.create_trial(values=[1.0, 1.0], user_attrs={
        RESULT.key: {"schema": SCHEMA, "feasible": True, "rate_rps": 50.0}, MACHINE_LOAD.key: {**busy, "others_cores": 0.01}}))
    assert fair_incumbent_rate(study) == pytest.approx(single_run_lower_rps(50.0))  # undisturbed, it is


def test_tied_is_judged_per_round_not_by_overlapping_intervals():
    from optimizer.search.attrs import BASELINE
    from optimizer.search.confirmed import Confirmation, Confirmed

    def trial(number, tok_s=None, baseline=False):
        attrs = {RESULT.key: {"schema": SCHEMA, "feasible": True}, **({BASELINE.key: True} if baseline else {})}
        t = optuna.trial.create_trial(values=[tok_s or 1.0, 50.0], user_attrs=attrs)
        t.number = number
        return t

    def confirmed(number, values, baseline=False):
        return Confirmed(trial(number, baseline=baseline), {r: trial(100 + r, v) for r, v in enumerate(values)})

    base = confirmed(0, [1227.0, 1318.0, 1150.0], baseline=True)
    best = confirmed(7, [1365.0, 1431.8, 1290.0])  # 8-11% ahead in every round
    rival = confirmed(9, [1330.0, 1460.0, 1250.0])  # behind, ahead of, behind the best
    c = Confirmation({"plan": "p", "rounds": 3, "candidates": [0, 7, 9]}, [base, best, rival])
    assert c.best is best
    assert c.interval(base).overlaps(c.interval(best))  # their own intervals overlap ...
    assert not c.tied(base)  # ... but every round put the best ahead: not tied
    assert c.gain(best).low > 0
    assert c.tied(rival) and not c.tied(best)


def _rounds_study(values: dict[int, list[float | None]], rounds: int, dropped: dict[int, int] | None = None):
    """A study of three search trials (#0 vLLM's defaults) and a confirmation plan of `rounds` rounds whose runs
    measured `values[config][round]` tok/s (None: that run is missing)."""
    from optuna.trial import create_trial

    from optimizer.search.attrs import BASELINE

    study = optuna.create_study(directions=["maximize", "minimize"])
    for n in range(3):
        study.add_trial(create_trial(values=[100.0, 50.0], user_attrs={**BASELINE.item(n == 0),
                                                                       **RESULT.item({"schema": SCHEMA, "feasible": True})}))
    STUDY_CONFIRMATION.set(study, {"plan": "3:2", "rounds": rounds, "candidates": [0, 1, 2],
                                   "limits": Limits.ttft_p99(150.0).model_dump(mode="json"),
                                   # one confidence for every look: 0.05 split equally over them
                                   "confidence": 1 - 0.05 / max(rounds - 1, 1), "precise_half_width": 0.05,
                                   "dropped": {str(k): v for k, v in (dropped or {}).items()}})
    runs = confirmation_study(study, create=True)
    for n, per_round in values.items():
        for r, v in enumerate(per_round):
            if v is not None:
                runs.add_trial(create_trial(values=[v, 50.0], user_attrs={
                    **CONFIRM.item({"plan": "3:2", "of": n, "round": r}), **RESULT.item({"schema": SCHEMA, "feasible": True})}))
    return study


def test_a_plan_with_the_error_split_widens_each_look_by_its_share():
    from optimizer.measurement.sequential import look_alpha

    values = {0: [100.0, 100.0, 101.0], 1: [120.0, 121.0, 118.0], 2: [90.0, 95.0, 92.0]}
    old = confirmation(_rounds_study(values, rounds=5))  # a plan stored before: one confidence for every look
    assert old.confidence == 1 - 0.05 / 4
    study = _rounds_study(values, rounds=5)
    STUDY_CONFIRMATION.set(study, {**STUDY_CONFIRMATION.of(study), "spending": 3})
    new = confirmation(study)
    assert math.isclose(new.confidence, 1 - look_alpha(5, 3))  # the look after the 3 full rounds: 0.05 x 19/125
    # the third look keeps 0.0076 of the error, less than the 0.0125 each look had: a wider interval than before
    assert new.gain(new.configs[1]).low < old.gain(old.configs[1]).low


def test_the_rounds_stop_once_the_gain_decides_within_five_points():
    # by hand: #1's gain over the defaults is +20% and +21% in rounds 1-2. The rounds are blocks of all three
    # configs: each moved by d = ln(round 2 / round 1) = 0, 0.00830, 0.05407 (mean 0.02079); over 2 rounds the
    # additive fit leaves (d - mean) / 2 in each, SSE = sum((d - mean)^2) / 2 = 0.000848, 2 degrees of freedom. At
    # 97.5% (t = 6.205) the half-width is 6.205 x sqrt(2 x 0.000848 / 2 / 2) = 0.1278 in log, around the mean log
    # ratio (ln 1.20 + ln 1.21) / 2 = 0.1865: [+6.0%, +36.9%], above 0 but +-15 points wide: round 3 narrows it
    study = _rounds_study({0: [100.0, 100.0], 1: [120.0, 121.0], 2: [90.0, 95.0]}, rounds=3)
    c = confirmation(study)
    assert c.outcome.value == "running" and c.best.number == 1
    assert math.isclose(c.gain(c.best).low, math.exp(0.18647 - 0.12776) - 1, abs_tol=1e-3)
    assert math.isclose(c.gain(c.best).high, math.exp(0.18647 + 0.12776) - 1, abs_tol=1e-3)
    runs, dropping = confirm.next_runs(c)
    assert sorted((t.number, r) for t, r in runs) == [(0, 2), (1, 2)]  # #2, a quarter behind #1, drops out
    assert dropping == {2: 2}
    # #2 at 90.0 and 90.5 instead: d = 0, 0.00830, 0.00554 (mean 0.00461), SSE = 1.786e-5, half-width 6.205 x
    # sqrt(2 x 1.786e-5 / 2 / 2) = 0.01854: [+18.3%, +22.8%], above 0 and within +-5 points: better, decided
    study = _rounds_study({0: [100.0, 100.0], 1: [120.0, 121.0], 2: [90.0, 90.5]}, rounds=3)
    c = confirmation(study)
    assert c.outcome.value == "better" and c.best.number == 1
    assert math.isclose(c.gain(c.best).low, math.exp(0.18647 - 0.01854) - 1, abs_tol=1e-3)
    assert math.isclose(c.gain(c.best).high, math.exp(0.18647 + 0.01854) - 1, abs_tol=1e-3)
    assert confirm.next_runs(c) == ([], {})  # no third round
    # a plan stored before the +-5 point rule stopped on the wide interval above 0, and still reads as it did
    study = _rounds_study({0: [100.0, 100.0], 1: [120.0, 121.0], 2: [90.0, 95.0]}, rounds=3)
    plan = dict(STUDY_CONFIRMATION.of(study))
    del plan["precise_half_width"]
    STUDY_CONFIRMATION.set(study, plan)
    assert confirmation(study).outcome.value == "better" and confirmation(study).complete


def test_a_confirmation_cut_short_above_0_says_better_so_far_and_how_to_go_on():
    from optimizer.config.settings import StudyConfig
    from optimizer.decision.verdict import answer_line, verdict_line

    config = StudyConfig(study_name="s", storage_url="sqlite:///s.db", ttft_p99_ms=150.0, budget=10, model="m")
    # the two studies of the test above: +20.5% [+6.0%, +36.9%] after 2 of 3 rounds (a deadline or Ctrl-C ends it
    # there), then the same gain within +-5 points
    cut = decide(_rounds_study({0: [100.0, 100.0], 1: [120.0, 121.0], 2: [90.0, 95.0]}, rounds=3), config)
    assert verdict_line(cut) == ("better so far than vLLM's defaults (vllm serve) by +20.5% output throughput "
                                 "[+6.0%, +36.9%] after 2 rounds, not yet within +-5 points: run the same command "
                                 "again to go on")
    done = decide(_rounds_study({0: [100.0, 100.0], 1: [120.0, 121.0], 2: [90.0, 90.5]}, rounds=3), config)
    assert verdict_line(done) == ("better than vLLM's defaults (vllm serve) by +20.5% output throughput "
                                  "[+18.3%, +22.8%], 2 rounds: deploy the recommendation")
    # cut short across 0: no direction yet
    across = decide(_rounds_study({0: [100.0, 100.0], 1: [96.0, 110.0], 2: [70.0, 71.0]}, rounds=3), config)
    assert verdict_line(across).startswith("not decided yet after 2 rounds (#1 +3.0% [")
    # the last screen's first line says the same in short
    assert answer_line(done) == ("decision: deploy #1: +20.5% output tok/s over vLLM's defaults [+18.3%, +22.8%] "
                                 "(2 rounds)")
    assert answer_line(cut) == ("decision: not decided yet after 2 rounds: #1 +20.5% [+6.0%, +36.9%] against vLLM's "
                                "defaults; run the same command again")


def test_a_candidate_clearly_behind_drops_out_of_the_next_round():
    # up to 4 rounds: 3 looks, each at 98.33%. After 3 rounds #1 is -4%, +10%, +4% against the defaults (undecided:
    # [-8.7%, +16.6%]); #2 trails #1 by about a third in every round: it drops out, and round 4 measures the
    # defaults and #1 alone
    study = _rounds_study({0: [100.0, 100.0, 100.0], 1: [96.0, 110.0, 104.0], 2: [70.0, 71.0, 70.0]}, rounds=4)
    c = confirmation(study)
    assert c.outcome.value == "running" and c.best.number == 1
    assert c.gain(c.best).low < 0 < c.gain(c.best).high
    runs, dropping = confirm.next_runs(c)
    assert dropping == {2: 3}
    assert sorted((t.number, r) for t, r in runs) == [(0, 3), (1, 3)]


def test_a_default_plan_spends_a_drop_outs_runs_on_more_rounds():
    # the study above, planned by default for 6 rounds of 3: #2 drops out after 3, and the 3 x 3 runs it leaves go to
    # rounds of the two still measured: 3 + 9 // 2 = 7 rounds (split.rounds_after_drop), the growth stored so that
    # the looks taken keep the error they spent (sequential.py::spent)
    values = {0: [100.0, 100.0, 100.0], 1: [96.0, 110.0, 104.0], 2: [70.0, 71.0, 70.0]}
    study = _rounds_study(values, rounds=6)
    STUDY_CONFIRMATION.set(study, {**STUDY_CONFIRMATION.of(study), "split": split.SPLIT_RULE, "spending": 3,
                                   "looks": "group-sequential"})
    plan_attr = confirm.enqueue(study, 6, {}, asked=False)
    assert plan_attr["dropped"] == {"2": 3}
    assert plan_attr["rounds"] == 7 and plan_attr["grown"] == [[3, 6]]
    assert STUDY_CONFIRMATION.of(study)["rounds"] == 7
    assert sorted((CONFIRM.of(t)["of"], CONFIRM.of(t)["round"]) for t in confirm.waiting(study)) == [(0, 3), (1, 3)]
    c = confirmation(study)
    assert c.rounds == 7 and c.plan["grown"] == [[3, 6]]
    # the runs are the budget's: 3 rounds of 3 and 4 of 2 are 17 of the 18 planned, as the report says them
    assert c.runs_planned == 17 <= 6 * 3 and c.shape == "3 rounds of 3 configs, then 4 of 2"
    # the look after round 3 spends what the plan of 6 gave it: its confidence moves by the simulation's noise alone
    from optimizer.measurement.sequential import look_confidence_at

    assert c.confidence == pytest.approx(look_confidence_at(6, 3), abs=0.002)
    # a default plan rerun with the user's --confirm 6 keeps its 6 rounds when #2 drops out
    asked = _rounds_study(values, rounds=6)
    STUDY_CONFIRMATION.set(asked, {**STUDY_CONFIRMATION.of(asked), "split": split.SPLIT_RULE, "spending": 3,
                                   "looks": "group-sequential"})
    assert confirm.enqueue(asked, 6, {}, asked=True)["rounds"] == 6
    assert "grown" not in STUDY_CONFIRMATION.of(asked) and "split" not in STUDY_CONFIRMATION.of(asked)
    assert split.rounds_after_drop(8, 4, 3, 2) == 10 and split.rounds_after_drop(8, 6, 3, 2) == 9
    assert split.rounds_after_drop(8, 8, 3, 2) == 8 and split.rounds_after_drop(8, 4, 2, 2) == 8


def test_a_rerun_under_another_default_keeps_its_plans_rounds():
    # a plan of 6 rounds, stored under another default, undecided after them: the same
    # command under the default of 8 queues nothing and keeps the plan (an explicit --confirm 8 would add two
    # rounds: test_a_rerun_with_more_rounds_adds_them_to_the_finished_plan)
    study = _rounds_study({0: [100.0] * 6, 1: [96.0, 110.0, 104.0, 99.0, 103.0, 97.0],
                           2: [95.0, 108.0, 101.0, 97.0, 104.0, 99.0]}, rounds=6)
    assert confirmation(study).outcome.value == "undecided"
    plan_attr = confirm.enqueue(study, 8, {}, asked=False)
    assert plan_attr["rounds"] == 6 and STUDY_CONFIRMATION.of(study)["rounds"] == 6
    assert confirm.waiting(study) == []


def test_a_missing_run_of_the_last_round_is_run_again_before_the_next_round():
    study = _rounds_study({0: [100.0, 100.0], 1: [104.0, 110.0], 2: [90.0, None]}, rounds=3)
    runs, dropping = confirm.next_runs(confirmation(study))
    assert [(t.number, r) for t, r in runs] == [(2, 1)] and dropping == {}


def test_a_config_that_dropped_out_is_not_waited_for():
    # #2 dropped out at round 2: round 2 is full with the defaults and #1 alone, and the rounds ran out
    study = _rounds_study({0: [100.0, 100.0, 101.0], 1: [104.0, 110.0, 103.0], 2: [70.0, 71.0]}, rounds=3,
                          dropped={2: 2})
    c = confirmation(study)
    assert c.full_rounds == [0, 1, 2] and [x.number for x in c.active] == [0, 1]
    assert c.outcome.value == "undecided" and confirm.next_runs(c) == ([], {})


def test_a_new_plan_looks_group_sequentially_and_compares_runs_by_their_fits():
    from optimizer.measurement.sequential import look_confidence_at
    from optimizer.search.confirmed import FIT_VALUE, run_tok_s

    values = {0: [100.0, 100.0, 101.0], 1: [120.0, 121.0, 118.0], 2: [90.0, 95.0, 92.0]}
    study = _rounds_study(values, rounds=5)
    STUDY_CONFIRMATION.set(study, {**STUDY_CONFIRMATION.of(study), "spending": 3})
    bonferroni = confirmation(study)
    STUDY_CONFIRMATION.set(study, {**STUDY_CONFIRMATION.of(study), "looks": "group-sequential", "value": FIT_VALUE})
    exact = confirmation(study)
    assert exact.confidence == pytest.approx(look_confidence_at(5, 3, configs=3))  # 3 candidates, 3 full rounds
    assert exact.confidence < bonferroni.confidence  # the looks share their rounds: less to pay
    assert exact.gain(exact.configs[1]).low > bonferroni.gain(bonferroni.configs[1]).low

    # a run's value: its fit's rate x the output tokens per request at its best passing probe
    from optuna.trial import create_trial
    run = create_trial(values=[1880.0, 50.0], user_attrs=RESULT.item({
        "schema": SCHEMA, "feasible": True, "rate_rps": 48.24, "request_throughput_rps": 47.0,
        "rate_at_limit": {"rate_rps": 53.66, "low_rps": 48.94, "high_rps": 58.95, "requests": 2409, "probes": 3}}))
    assert run_tok_s(run) == pytest.approx(53.66 * 1880.0 / 47.0)  # 2146.4 tok/s, against goodput's 1880
    no_fit = create_trial(values=[1880.0, 50.0],
                          user_attrs=RESULT.item({"schema": SCHEMA, "feasible": True, "rate_rps": 48.24}))
    assert run_tok_s(no_fit) == 1880.0  # without a fit (fixed-length replays): its goodput
    missed = create_trial(values=[0.0, 500.0], user_attrs=RESULT.item({"schema": SCHEMA, "feasible": False}))
    assert run_tok_s(missed) == 0.0
    # plans stored before compare goodput; the rounds' values here have no fit, so both read the same
    assert exact.values_tok_s(exact.configs[0]) == bonferroni.values_tok_s(bonferroni.configs[0]) == values[0]


def test_an_undecided_confirmation_says_how_many_more_rounds_would_decide_it():
    from optimizer.decision.decide import Decision
    from optimizer.measurement import sequential

    # 3 rounds, the plan's last: #1 -4%, +10%, +4% against the defaults, undecided
    c = confirmation(_rounds_study({0: [100.0, 100.0, 100.0], 1: [96.0, 110.0, 104.0], 2: [70.0, 71.0, 70.0]},
                                   rounds=3))
    assert c.outcome.value == "undecided" and c.best.number == 1
    gain = c.gain(c.best)  # the leader's gain is the one projected, at the plan's confidence and 3 configs
    assert c.rounds_to_decide() == sequential.rounds_to_decide(gain, c.confidence, 3, 3)
    # the defaults lead: each other candidate must decide, so the most any needs (#2, 30% behind, decides: 0)
    lead = confirmation(_rounds_study({0: [100.0, 110.0, 104.0], 1: [96.0, 100.0, 100.0], 2: [70.0, 71.0, 70.0]},
                                      rounds=3))
    assert lead.best.number == 0 and lead.outcome.value == "undecided"
    assert sequential.rounds_to_decide(lead.gain(lead.configs[2]), lead.confidence, 3, 3) == 0
    assert lead.rounds_to_decide() == sequential.rounds_to_decide(lead.gain(lead.configs[1]), lead.confidence, 3, 3)

    def advice(k):
        return Decision("s", 150.0, 150.0, [], [], None, None, more_rounds="optimize --study s --confirm 4",
                        rounds_needed=k, rounds_projected=True).more_rounds_advice

    assert advice(2) == ("`optimize --study s --confirm 4` adds a round; about 2 more rounds would be expected to "
                         "decide it, if the gain and the spread stay as measured")
    assert advice(1).count("about 1 more round would") == 1
    assert advice(None).endswith(f"more than {sequential.PROJECTED_ROUNDS} more rounds would be needed to decide it")
    # one round: no spread to project from, the command alone
    assert Decision("s", 150.0, 150.0, [], [], None, None, more_rounds="optimize --study s --confirm 2"
                    ).more_rounds_advice == "`optimize --study s --confirm 2` adds a round"


def test_a_plan_of_the_defaults_alone_shows_plain_95_percent_intervals():
    # no searched config met the limit, so the defaults are confirmed alone, 2 rounds of a 12-round plan; at the
    # first look's share of 12 looks their interval would read [0.0, 332486.2] tok/s. With no gain to look at the
    # rounds stop after round 2 whatever they measure, so it is the plain t interval: 4000 and 4140 tok/s have
    # mean 4070, s = 140 / sqrt(2) = 98.99, half-width t(0.975, 1) 12.706 x 98.99 / sqrt(2) = 889.4.
    from optimizer.measurement.sequential import Outcome

    study = _rounds_study({0: [4000.0, 4140.0]}, rounds=12)
    STUDY_CONFIRMATION.set(study, {**STUDY_CONFIRMATION.of(study), "candidates": [0], "spending": 3,
                                   "looks": "group-sequential"})
    alone = confirmation(study)
    assert alone.confidence == 0.95 and alone.outcome == Outcome.KEEP
    i = alone.interval(alone.configs[0])
    assert i.low == pytest.approx(4070 - 889.4, abs=0.2) and i.high == pytest.approx(4070 + 889.4, abs=0.2)
    # the same two rounds in a plan of three configs are a look of many: a wider interval
    study = _rounds_study({0: [4000.0, 4140.0], 1: [4100.0, 4200.0], 2: [3900.0, 4000.0]}, rounds=12)
    STUDY_CONFIRMATION.set(study, {**STUDY_CONFIRMATION.of(study), "spending": 3, "looks": "group-sequential"})
    three = confirmation(study)
    assert three.confidence > 0.99 and three.interval(three.configs[0]).high > i.high


def test_when_the_rounds_keep_the_defaults_the_leader_is_tied_with_them_not_the_recommendation():
    # #1 leads by a median of +0.5% with a per-round gain of [-1.0%, +1.8%]: within +-3 points, so the rounds keep
    # vLLM's defaults. The recommendation is then the defaults, and "tied" says who the rounds do not rank apart from
    # them: #1, the leader (before, "tied" was judged against the leader, which left #1 out of it)
    study = _rounds_study({0: [100.0, 102.0, 98.0, 101.0], 1: [101.0, 101.5, 98.5, 101.5],
                           2: [90.0, 92.0, 87.0, 91.0]}, rounds=4)
    c = confirmation(study)
    assert c.outcome.value == "keep" and c.best.number == 1 and c.recommended is c.base
    assert c.gain(c.best).low < 0 < c.gain(c.best).high
    assert c.tied(c.best) and not c.tied(c.base)
    assert c.gain(c.configs[2]).high < 0 and not c.tied(c.configs[2])  # #2, 10% behind the defaults every round


def test_keeping_the_defaults_gives_the_tied_candidates_width_and_names_the_ones_behind():
    from optimizer.config.settings import StudyConfig
    from optimizer.decision.verdict import answer_line, verdict_line

    config = StudyConfig(study_name="s", storage_url="sqlite:///s.db", ttft_p99_ms=150.0, budget=10, model="m")
    # the defaults lead; #1 is within +-3 points of them, #2 about 10% behind in every round. Before, the sentence
    # took its width from every candidate's bounds: "within +-11.8% of vLLM's defaults", #2's low end
    d = decide(_rounds_study({0: [101.0, 101.5, 98.5, 101.5], 1: [100.0, 102.0, 98.0, 101.0],
                              2: [90.0, 92.0, 87.0, 91.0]}, rounds=4), config)
    assert d.confirmation.outcome.value == "keep" and d.confirmation.best is d.confirmation.base
    line = verdict_line(d)
    assert line.startswith("within +-1.7% of vLLM's defaults (vllm serve) (#1 -0.7% [-1.7%, +1.0%]), behind them: "
                           "#2 -10.6% [") and line.endswith(", 4 rounds: keep them")
    assert answer_line(d) == "decision: keep vLLM's defaults: the closest rival is #1 -0.7% [-1.7%, +1.0%] (4 rounds)"


def test_the_defaults_go_to_the_rounds_only_where_they_met_the_limit_in_the_search(monkeypatch):
    # a limit vLLM's defaults meet at no rate tried: rounds of them give no gain to decide and would run to the end
    # undecided, so the confirmation compares the others alone
    from optuna.trial import create_trial

    from optimizer.search.attrs import BASELINE, STUDY_CONFIG

    def curve(ttft_ms):
        return {**RESULT.item({"schema": SCHEMA}), **CURVE.item([
            {"offered_rate_rps": 10.0, "sustained": True, "stats": {"ttft": {"p99": ttft_ms}},
             "output_throughput_tok_s": 300.0},
            {"offered_rate_rps": 12.0, "sustained": True, "stats": {"ttft": {"p99": 400.0}},
             "output_throughput_tok_s": 330.0}])}

    def study_with(defaults_ttft_ms):
        study = optuna.create_study(directions=["maximize", "minimize"])
        STUDY_CONFIG.set(study, json.dumps({"limits": Limits.ttft_p99(150.0).model_dump(mode="json"), "engine_args": {}}))
        for n, ttft in enumerate((defaults_ttft_ms, 90.0, 100.0)):
            study.add_trial(create_trial(values=[300.0, ttft], user_attrs={**BASELINE.item(n == 0), **curve(ttft)}))
        return study

    assert [t.number for t in confirm.candidates(study_with(120.0))][:1] == [0]  # met it at 10 req/s: measured
    missed = [t.number for t in confirm.candidates(study_with(180.0))]
    assert 0 not in missed and missed[0] in (1, 2)
    # the plan of the others alone is the first look's 2 rounds, not 12 rounds of 2 that could decide nothing
    study = study_with(180.0)
    monkeypatch.setattr(confirm, "run_spec", lambda *a: {"start_rps": 10.0, "failed_rps": None})
    assert confirm.enqueue(study, 8, {}, asked=False)["rounds"] == 2
    # and rounds without the defaults end at that look, whatever they measure
    rounds = _rounds_study({1: [120.0, 121.0], 2: [90.0, 119.0]}, rounds=12)
    STUDY_CONFIRMATION.set(rounds, {**STUDY_CONFIRMATION.of(rounds), "candidates": [1, 2]})
    c = confirmation(rounds)
    assert c.base is None and c.outcome.value == "undecided" and c.complete and confirm.next_runs(c) == ([], {})
    from optimizer.config.settings import StudyConfig
    from optimizer.decision.verdict import verdict_line

    config = StudyConfig(study_name="s", storage_url="sqlite:///s.db", ttft_p99_ms=150.0, budget=10, model="m")
    assert verdict_line(decide(rounds, config)) == ("vLLM's defaults were not measured again (they met the limit at "
                                                    "no rate the search tried): no gain to confirm (2 rounds)")


def test_rounds_over_with_a_served_run_missing_say_how_to_measure_it():
    from optimizer.config.settings import StudyConfig
    from optimizer.decision.views import confirmation_lines

    config = StudyConfig(study_name="s", storage_url="sqlite:///s.db", ttft_p99_ms=150.0, budget=10, model="m")
    study = _rounds_study({0: [100.0, 100.0], 1: [120.0, 121.0], 2: [90.0, 90.5]}, rounds=3)  # decided: better
    STUDY_CONFIRMATION.set(study, {**STUDY_CONFIRMATION.of(study), "served": True})  # neither served run ran
    d = decide(study, config)
    assert d.confirmation.complete and [x.number for x in d.confirmation.served_missing] == [0, 1]
    assert confirmation_lines(d)[-1] == ("note: the runs through `vllm serve` stopped before #0, #1 ran: run the same "
                                         "command again to measure them as served")


def test_a_gain_over_defaults_with_a_median_of_0_falls_back_to_the_per_round_median():
    # the defaults met the limit in one round of three (0 tok/s in the others): no ratio of medians ("+nan%"
    # before); round 3 alone gives a ratio, 125 / 100 - 1
    from optimizer.decision.numbers import confirmed_gain

    c = confirmation(_rounds_study({0: [0.0, 0.0, 100.0], 1: [120.0, 121.0, 125.0], 2: [90.0, 91.0, 92.0]}, rounds=3))
    g = confirmed_gain(c, c.configs[1])
    assert g is not None and g.pct == pytest.approx(25.0) and not g.known


def test_a_run_disturbed_by_other_processes_is_run_again_once_then_kept():
    # a real round: 80 s of unit tests beside vLLM's defaults' run put them at 79.5 req/s against 96-111 in
    # their other rounds. A run that others took a quarter of a core from is not counted: its round misses it, and
    # it is queued again on the same draw; after 2 disturbed tries the second is kept, as it is
    from optuna.trial import create_trial

    from optimizer.measurement.disturbance import load_summary
    from optimizer.search.attrs import MACHINE_LOAD

    busy = load_summary(90.0, 170.0, 0.0, 90.0, {0, 1})  # others took 80 s of the 90: 0.89 of a core
    quiet = load_summary(50.0, 51.0, 0.0, 50.0, {0, 1})

    def add_run(study, of, round_, tok_s, load):
        confirmation_study(study).add_trial(create_trial(values=[tok_s, 50.0], user_attrs={
            **CONFIRM.item({"plan": "3:2", "of": of, "round": round_}), **RESULT.item({"schema": SCHEMA, "feasible": True}),
            **MACHINE_LOAD.item(load)}))

    study = _rounds_study({0: [100.0], 1: [120.0], 2: [90.0]}, rounds=3)
    add_run(study, 1, 1, 121.0, quiet)
    add_run(study, 2, 1, 91.0, quiet)
    add_run(study, 0, 1, 70.0, busy)
    c = confirmation(study)
    assert c.full_rounds == [0] and 1 not in c.base.runs
    runs, _ = confirm.next_runs(c)
    assert [(x.number, r) for x, r in runs] == [(0, 1)]  # the defaults' run of round 2, again
    add_run(study, 0, 1, 101.0, quiet)  # run again undisturbed: that one counts
    c = confirmation(study)
    assert c.full_rounds == [0, 1] and c.base.value_tok_s(1) == 101.0
    # disturbed twice: the round keeps the second rather than run it again and again (a machine that stays busy
    # costs twice the runs, no more), and a later run (another worker's duplicate) does not replace it
    study = _rounds_study({0: [100.0], 1: [120.0], 2: [90.0]}, rounds=3)
    add_run(study, 1, 1, 121.0, quiet)
    add_run(study, 2, 1, 91.0, quiet)
    add_run(study, 0, 1, 70.0, busy)
    assert 1 not in confirmation(study).base.runs
    add_run(study, 0, 1, 80.0, busy)
    assert confirmation(study).base.value_tok_s(1) == 80.0
    add_run(study, 0, 1, 99.0, quiet)
    assert confirmation(study).base.value_tok_s(1) == 80.0
    assert confirm.describe(confirmation_study(study).trials[-2]).endswith(
        "; disturbed (other processes took 0.89 of a core, the hypervisor 0.00): not counted unless its round's 2 "
        "tries all are")
    # a run that could not measure (pruned: its engine died, and an orphaned worker's time reads as others') is
    # never called disturbed: it counts as it is
    from optuna.trial import TrialState

    study = _rounds_study({0: [100.0], 1: [120.0], 2: [90.0]}, rounds=3)
    confirmation_study(study).add_trial(create_trial(state=TrialState.PRUNED, user_attrs={
        **CONFIRM.item({"plan": "3:2", "of": 0, "round": 1}), **MACHINE_LOAD.item(busy)}))
    assert 1 in confirmation(study).base.runs


def test_with_layouts_of_different_sizes_the_incumbent_compares_per_gpu():
    study = optuna.create_study(directions=["maximize", "minimize"])

    def add(rate, tp):
        study.add_trial(optuna.trial.create_trial(values=[1.0, 1.0], user_attrs={
            RESULT.key: {"schema": SCHEMA, "feasible": True, "rate_rps": rate},
            ENGINE_PARAMS.key: {"tensor_parallel_size": tp}}))

    add(40.0, 4)  # 10 req/s per GPU
    add(12.0, 1)  # 12 req/s per GPU: the best per GPU, though a third of the other's rate
    low = 1 - 1.645 * 0.06
    assert fair_incumbent_rate(study, gpus=1) == pytest.approx(12.0 * low)  # not 0.9 x 40 for a 1-GPU trial
    assert fair_incumbent_rate(study, gpus=2) == pytest.approx(24.0 * low)
    assert fair_incumbent_rate(study, gpus=4) == pytest.approx(48.0 * low)
    # a layout fixed by the engine arguments counts as the trials' own
    # (x 2 GPUs each: 40 req/s on 8, 12 on 2, the best per GPU 6)
    assert fair_incumbent_rate(study, gpus=2, engine_args={"pipeline_parallel_size": 2}) == pytest.approx(12.0 * low)
