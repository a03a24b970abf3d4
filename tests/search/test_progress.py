"""The console of a run (search/progress.py, counted by search/runner.py's Tally): one estimate of the time left
over the search and the confirmation, counted down on the clock between trials; a live bar on a terminal, plain
lines elsewhere; trial lines in rates. The clock is a scripted one: `clock.t` is what the display reads."""

import io
import os
import sys

from optuna.trial import create_trial

from optimizer.config.limits import Limits
from optimizer.core.processes import output_to
from optimizer.search.attrs import CONFIRM, STUDY_CONFIRMATION, TIMINGS
from optimizer.search.objective import CONSTRAINT
from optimizer.search.missed import why_infeasible
from optimizer.search.progress import Progress, Status, Ticker, describe, work_s
from optimizer.search.progress import Tally
from optimizer.search.study import confirmation_study
from tests.support import synthetic


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_work_left_by_hand():
    assert work_s(30, 60.0, 9, 80.0) == 30 * 60 + 9 * 80  # trials, then the confirmation's runs
    assert work_s(0, None, 3, 80.0) == 240.0  # the search is over: its estimate is not needed
    assert work_s(30, None, 9, 80.0) is None  # nothing measured yet
    assert work_s(None, 60.0, 9, 80.0) is None  # a deadline alone: the trials left are not counted
    assert work_s(0, 60.0, 0, None) == 0.0


def test_the_estimate_counts_down_between_trials_and_holds_the_work_not_started():
    s = Status("search", 10, 40, at_s=1000.0, work_s=600.0, next_s=60.0)
    assert s.left_s(1000.0) == 600.0
    assert s.left_s(1030.0) == 570.0  # the clock ticks: the trial running now is half done
    assert s.left_s(1100.0) == 540.0  # it runs long: what has not started yet is still left
    with_deadline = Status("search", 10, 40, at_s=1000.0, work_s=600.0, next_s=60.0, deadline_unix_s=1300.0)
    assert with_deadline.left_s(1000.0) == 300.0 and with_deadline.left_s(1400.0) == 0.0
    assert Status("search", 0, None, at_s=0.0).left_s(5.0) is None
    assert Status("search", 0, None, at_s=0.0, deadline_unix_s=3600.0).left_s(600.0) == 3000.0


def test_the_status_line_reads_like_with_like():
    s = Status("confirmation 2/9", 33, 40, at_s=1000.0, work_s=420.0, next_s=60.0)
    assert s.text(started_s=0.0, now_s=1000.0) == "33/40 confirmation 2/9, 16m40s elapsed, ~7m00s left"
    best = Status("search", 12, 40, at_s=0.0, work_s=None, best="best #7: 1374.9 tok/s at 37.60 req/s")
    assert best.text(0.0, 5.0) == "12/40 search, 5s elapsed, time left unknown, best #7: 1374.9 tok/s at 37.60 req/s"
    deadline = Status("search", 12, None, at_s=0.0, deadline_unix_s=3600.0)
    assert deadline.text(0.0, 600.0) == "12 done (search), 10m00s elapsed, ~50m00s left"  # --budget 8h: no count
    late = Status("confirmation 8/9", 39, 40, at_s=0.0, work_s=60.0, next_s=60.0)
    assert late.text(0.0, 90.0).endswith("1m30s elapsed, finishing")  # the last run is late: no "~0s left"


def test_a_log_gets_lines_and_a_still_running_line_at_most_every_heartbeat():
    clock, out = Clock(), io.StringIO()  # a StringIO is no terminal: no bar
    p = Progress(Status("search", 0, 4, at_s=1000.0, work_s=400.0, next_s=100.0), stream=out, now=clock,
                 heartbeat_s=300.0, thread=False)
    assert not p.live
    clock.t += 100
    p.write("trial #0: 10.00 req/s at the limit")
    p.update(Status("search", 1, 4, at_s=clock.t, work_s=300.0, next_s=100.0))
    for _ in range(299):  # a second's ticks, up to 299 s after the last line
        clock.t += 1
        p.tick()
    assert out.getvalue() == "trial #0: 10.00 req/s at the limit\n"
    clock.t += 1
    p.tick()
    p.tick()
    lines = out.getvalue().splitlines()
    assert lines[1:] == ["still running: 1/4 search, 6m40s elapsed, ~3m20s left"]  # one, not one per tick
    p.close()
    assert "\r" not in out.getvalue() and "" not in out.getvalue().splitlines()


def drawn(out: io.StringIO) -> str:
    """What the terminal shows last on the bar's line."""
    return out.getvalue().rstrip("\n").rsplit("\r", 1)[-1].rstrip()


def test_a_terminal_gets_a_bar_whose_clock_ticks_and_whose_total_shrinks():
    clock, out = Clock(), io.StringIO()
    p = Progress(Status("search", 30, 40, at_s=1000.0, work_s=600.0, next_s=60.0), stream=out, live=True,
                 now=clock, thread=False)
    clock.t += 65
    p.tick()  # no trial ended: the clock alone moved the display
    assert drawn(out).endswith("| 30/40 search, 1m05s elapsed, ~9m00s left")
    p.write("trial #30: 10.00 req/s at the limit")
    assert "trial #30: 10.00 req/s at the limit\n" in out.getvalue()
    p.update(Status("confirmation 3/9", 34, 40, at_s=clock.t, work_s=360.0, next_s=60.0))
    assert drawn(out).endswith("| 34/40 confirmation 3/9, 1m05s elapsed, ~6m00s left")
    p.update(Status("confirmation 3/3", 34, 34, at_s=clock.t, work_s=0.0))  # decisive after 3 runs: ended early
    p.close()
    assert drawn(out).startswith("|####################| 34/34 confirmation 3/3, 1m05s elapsed, ~0s left")


def _trial(number: int, **result):
    """A finished trial as the objective stores it: its result, its duration, its constraint (over the limit: > 0)."""
    trial = create_trial(values=[result["output_throughput_tok_s"], result["ttft_p99_ms"]],
                         user_attrs={**synthetic.stored(**result), **TIMINGS.item({"total_s": 42})},
                         constraints={CONSTRAINT: 0.0 if result["feasible"] else result["ttft_p99_ms"] - 150.0})
    trial.number = number
    return trial


def test_a_trial_that_missed_says_so_in_rates_and_without_another_regimes_throughput():
    stopped = {"feasible": False, "stopped_early": True, "floor_rps": 33.84, "rate_rps": 33.84, "ttft_p99_ms": 2550.0,
               "output_throughput_tok_s": 1476.1, "requests": 310}
    line = describe(_trial(22, **stopped))
    assert line == ("trial #22: over the limit down to 33.84 req/s, 0.9 x the best's lower bound (TTFT P99 2.55s at "
                    "33.84 req/s): it cannot beat the best, stopped early (310 requests) [42s]")
    assert "tok/s" not in line  # its throughput was measured over the limit: not comparable with the best's
    missed = why_infeasible(synthetic.measurement(feasible=False, rate_rps=2.5, ttft_p99_ms=180.0, requests=600))
    assert missed == "over the limit at every rate tried (TTFT P99 180ms at 2.50 req/s, the closest) (600 requests)"
    assert "at a burst" in why_infeasible(synthetic.measurement(feasible=False, rate_rps=None, ttft_p99_ms=180.0))
    # a demo's trial #15: its probe at 87.13 req/s stopped with 5 of 26 requests past the limit
    # and still waiting for a first token; the P99 of the 21 answered, 139 ms, alone read as under the limit
    cut = {"feasible": False, "stopped_early": True, "floor_rps": 87.13, "rate_rps": 87.13, "ttft_p99_ms": 139.4,
           "requests": 78, "requests_at_rate": 26, "over_limit_at_rate": 5, "answered_at_rate": 21}
    assert why_infeasible(synthetic.measurement(**cut)) == ("over the limit down to 87.13 req/s, 0.9 x the best's lower bound (TTFT P99 139ms "
                                   "of the 21 answered at 87.13 req/s, 5 of 26 requests over the limit): it cannot "
                                   "beat the best, stopped early (78 requests)")
    whole = {**cut, "ttft_p99_ms": 219.0, "answered_at_rate": 26}
    assert "(TTFT P99 219ms at 87.13 req/s, 5 of 26 requests over the limit)" in why_infeasible(synthetic.measurement(**whole))
    # a demo's trial #13: none of 53 over, but the backlog grew over the arrivals
    behind = {**cut, "ttft_p99_ms": 143.0, "requests_at_rate": 53, "over_limit_at_rate": 0, "answered_at_rate": 53,
              "behind_at_rate": True}
    assert "(TTFT P99 143ms at 87.13 req/s, 0 of 53 requests over the limit, falling behind)" in why_infeasible(synthetic.measurement(**behind))
    burst = describe(_trial(3, feasible=True, rate_rps=None, ttft_p99_ms=90.0, output_throughput_tok_s=800.0,
                            values_at_rate_ms={"ttft:p99": 90.0}))
    assert burst == "trial #3: a burst; 800.0 tok/s, TTFT P99 90ms at a burst [42s]"  # not "at 0.00 req/s"


def test_the_count_covers_the_budget_and_follows_the_confirmation_as_it_shrinks(tmp_path):
    """The synthetic study: 5 search trials done of 5; 3 rounds of 3 configs planned, of which the queued plan holds 2
    configs, and the confirmation ends after 4 runs. A rerun counts the runs of the stored plan as done."""
    study, _ = synthetic.build(tmp_path)
    tally = Tally(search_budget=5, runs_planned=9)
    search = tally.status(study, trial_s=60.0, run_s=80.0, deadline_unix_s=None)
    assert (search.phase, search.done, search.total, search.work_s) == ("search", 5, 14, 9 * 80.0)
    assert search.best.startswith("best #2: 770.0 tok/s at 7.70 req/s")  # the synthetic study's recommendation
    tally.confirm(9)
    STUDY_CONFIRMATION.set(study, {"plan": "5:4", "rounds": 3, "candidates": [0, 2], "limits": Limits.ttft_p99(100.0).model_dump(mode="json")})
    tally.run_done(study)
    first = tally.status(study, trial_s=60.0, run_s=80.0, deadline_unix_s=None)
    assert (first.phase, first.done, first.total, first.work_s, first.best) == ("confirmation 1/6", 6, 11, 400.0, "")
    for _ in range(3):
        tally.run_done(study)
    tally.confirmed()  # decisive after 4 runs
    assert tally.status(study, 60.0, 80.0, None).total == 9
    runs = confirmation_study(study, create=True)  # where the runs are stored
    runs.add_trial(create_trial(values=[500.0, 90.0], constraints={CONSTRAINT: 0.0}, user_attrs=CONFIRM.item(
        {"plan": "5:4", "of": 2, "round": 0})))
    again = Tally(search_budget=5, runs_planned=6)
    again.resume(study)
    assert (again.runs_done, again.status(study, 60.0, 80.0, None).done) == (1, 6)
    STUDY_CONFIRMATION.set(study, {"plan": "4:3", "rounds": 3, "candidates": [0, 2], "limits": Limits.ttft_p99(100.0).model_dump(mode="json")})
    stale = Tally(search_budget=5, runs_planned=6)
    stale.resume(study)  # a plan of a shorter search before: none of its runs is this search's
    assert stale.runs_done == 0


def test_the_display_reaches_the_console_while_a_trial_points_stderr_at_its_engine_log(tmp_path, capfd, monkeypatch):
    """While an engine starts, descriptor 2 is its log (core/processes.py `output_to`): the engine's output goes
    there, the display's lines (and a live bar's redraws) still to the console."""
    monkeypatch.setattr(sys, "stderr", open(2, "w", buffering=1, closefd=False))  # as in a process of its own
    p = Progress(Status("search", 0, 2, at_s=0.0), live=False, thread=False)
    with output_to(tmp_path / "engine.log"):
        os.write(2, b"INFO engine starting\n")
        p.write("still running: 0/2 search")
    p.close()
    assert capfd.readouterr().err == "still running: 0/2 search\n"
    assert (tmp_path / "engine.log").read_text() == "INFO engine starting\n"


def test_a_served_run_that_missed_everywhere_says_how_close_it_came():
    from optimizer.search.confirm import describe as describe_run

    missed = {"feasible": False, "rate_rps": 26.62, "ttft_p99_ms": 320.0, "output_throughput_tok_s": 748.4,
              "requests": 667}
    run = create_trial(values=[748.4, 320.0], constraints={CONSTRAINT: 170.0},
                       user_attrs={**synthetic.stored(**missed), **TIMINGS.item({"total_s": 93}),
                                   **CONFIRM.item({"plan": "29:28", "of": 0, "round": 3, "workload_seed": 4,
                                                   "served": True})})
    run.number = 9
    line = describe_run(run)
    assert line.startswith("as served (`vllm serve` over HTTP), trial #0 again (run ") and "seed 4): over" in line
    assert "over the limit at every rate tried (TTFT P99 320ms at 26.62 req/s, the closest) (667 requests)" in line
    flat = {**missed, "flat": True}  # the descent stopped: its tail did not fall with the rate
    assert why_infeasible(synthetic.measurement(**flat)) == ("over the limit at every rate tried, and the latency did not fall as the rate fell "
                                    "(TTFT P99 320ms at 26.62 req/s, the closest): not a queue that a lower rate "
                                    "drains, stopped (667 requests)")


def test_a_step_before_the_first_trial_ticks_on_a_terminal_and_leaves_no_line():
    clock, out, said = Clock(), io.StringIO(), []
    with Ticker("probe: measuring this machine", said.append, stream=out, live=True, now=clock, thread=False) as t:
        assert drawn(out) == "probe: measuring this machine, 0s elapsed"
        clock.t += 23
        t.tick()
        assert drawn(out) == "probe: measuring this machine, 23s elapsed"
        t.write("probe: lone 256-token prefill 106ms")  # the step's own line, above the live one
    assert "probe: lone 256-token prefill 106ms\n" in out.getvalue() and not said
    assert drawn(out) == ""  # the live line is gone: the next line starts clean


def test_a_step_before_the_first_trial_writes_no_redraws_to_a_log():
    clock, out, said = Clock(), io.StringIO(), []
    with Ticker("probe: measuring this machine", said.append, stream=out, live=False, now=clock, thread=False) as t:
        clock.t += 23
        t.tick()
        t.write("probe: lone 256-token prefill 106ms")
    assert out.getvalue() == "" and said == ["probe: lone 256-token prefill 106ms"]


def test_a_search_trial_others_disturbed_says_so_on_its_line():
    from optimizer.measurement.disturbance import load_summary
    from optimizer.search.attrs import MACHINE_LOAD

    stopped = {"feasible": False, "stopped_early": True, "floor_rps": 33.84, "rate_rps": 33.84, "ttft_p99_ms": 2550.0,
               "output_throughput_tok_s": 1476.1, "requests": 310}
    trial = _trial(22, **stopped)
    plain = describe(trial)
    trial.user_attrs.update(MACHINE_LOAD.item(load_summary(40.0, 74.0, 0.0, 34.0, {0, 1})))
    assert describe(trial) == plain + "; disturbed: other processes took 1.00 of a core, the hypervisor 0.00"
    trial.user_attrs.update(MACHINE_LOAD.item(load_summary(40.0, 80.0, 0.0, 79.5, {0, 1})))
    assert describe(trial) == plain  # 0.01 of a core: the kernel's own threads, not a disturbance
    met = _trial(23, feasible=True, rate_rps=50.0, ttft_p99_ms=80.0, output_throughput_tok_s=1500.0, requests=900)
    plain = describe(met)
    met.user_attrs.update(MACHINE_LOAD.item(load_summary(40.0, 74.0, 0.0, 34.0, {0, 1})))
    assert describe(met) == plain + ("; disturbed: other processes took 1.00 of a core, the hypervisor 0.00; no "
                                     "incumbent for the trials after it")  # search/incumbent.py leaves it out
