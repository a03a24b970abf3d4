"""Each probe judged under the report's limit (decision/probes.py), on hand-made points: passed, or which of the three
reasons failed it; and the chart draws one marker per probe on axes shared by every panel."""

import re

from optimizer.config.limits import Limit, Limits
from optimizer.decision.probes import BEHIND, OVER, PASSED, WITHDRAWN, Axes, Panel, chart_html, outcome

TTFT_TPOT = Limits(items=(Limit(metric="ttft", stat="p99", value_ms=30.0), Limit(metric="tpot", stat="p99",
                                                                                  value_ms=50.0)))


def probe(rate_rps=10.0, ttft_p99_ms=20.0, requests=40, over_limit=0, verdict="pass", sustained=True, completed=40,
          failed=0, feasible=True, limit_ms=30.0):
    """A probe sized by evidence, judged at the TTFT P99 limit `limit_ms`, as the curve stores it."""
    return {"offered_rate_rps": rate_rps, "ttft_p99_ms": ttft_p99_ms, "requests": requests, "over_limit": over_limit,
            "verdict": verdict, "sustained": sustained, "completed": completed, "failed": failed,
            "feasible": feasible, "limit_ms": limit_ms, "output_throughput_tok_s": 100.0,
            "stats": {"ttft": {"p99": ttft_p99_ms}},
            "limits_key": None if limit_ms is None else Limits.ttft_p99(limit_ms).key}


def test_a_passed_probe_says_its_count():
    got = outcome(probe(over_limit=0), 30.0)
    assert got == outcome(probe(), 30.0) and got.kind == PASSED
    assert got.words == "passed: 0 of 40 over the limit, TTFT P99 20ms"


def test_over_the_limit_by_its_count_at_the_limit_it_was_judged_at():
    got = outcome(probe(ttft_p99_ms=45.0, over_limit=13, verdict="fail", feasible=False), 30.0)
    assert got.kind == OVER and got.words == "failed: 13 of 40 over the limit, TTFT P99 45ms"
    # unsettled at its last request with 1 of 40 over (more than 1%): it fails, and says it was not settled
    close = outcome(probe(ttft_p99_ms=30.4, over_limit=1, verdict="unsettled", feasible=False), 30.0)
    assert close.kind == OVER and close.words == "failed: 1 of 40 over the limit (more than 1%, unsettled), TTFT P99 " \
                                                 "30.4ms"  # a decimal more: not '30ms' beside a 30 ms limit


def test_fell_behind_comes_first_and_withdrawn_requests_are_named():
    got = outcome(probe(ttft_p99_ms=80.0, over_limit=12, requests=27, verdict="fail", sustained=False, failed=6,
                        feasible=False), 30.0)
    assert got.kind == BEHIND
    assert got.words == ("failed: fell behind: its queue grew while requests arrived; 12 of 27 over the limit, "
                         "TTFT P99 80ms; 6 withdrawn or failed before their first token")
    only_withdrawn = outcome(probe(over_limit=0, verdict="fail", failed=3, feasible=False), 30.0)
    assert only_withdrawn.kind == WITHDRAWN and "3 withdrawn" in only_withdrawn.words
    assert outcome(probe(completed=0, feasible=False), 30.0).words.startswith("failed: no request completed")


def test_at_another_limit_a_probe_is_judged_by_its_p99():
    p = probe(ttft_p99_ms=45.0, over_limit=13, verdict="fail", feasible=False)
    assert outcome(p, 50.0).kind == PASSED  # re-ranked: sustained, P99 within 50 ms
    assert outcome(p, 40.0).words == "failed: TTFT P99 45ms over 40ms"
    def with_tpot(tpot_p99_ms):
        return {**probe(), "stats": {"ttft": {"p99": 20.0}, "tpot": {"p99": tpot_p99_ms}}}

    tpot = outcome(with_tpot(60.0), TTFT_TPOT)  # judged at TTFT alone: its P99s answer
    assert tpot.kind == OVER and tpot.words == "failed: TPOT P99 60ms over 50ms"
    assert outcome(with_tpot(41.0), TTFT_TPOT).words == "passed: TTFT P99 20ms, TPOT P99 41ms"


def two_limit_probe(tpot_over, tpot_verdict, feasible, tpot_p99_ms):
    """A probe judged at TTFT P99 <= 30ms and TPOT P99 <= 50ms, with each limit's part of its verdict."""
    parts = [{"key": "ttft:p99", "verdict": "pass", "requests": 800, "over_limit": 2, "value_ms": 24.0},
             {"key": "tpot:p99", "verdict": tpot_verdict, "requests": 800, "over_limit": tpot_over,
              "value_ms": tpot_p99_ms, "within": tpot_over <= 8}]
    return {**probe(requests=800, over_limit=tpot_over, verdict=tpot_verdict, feasible=feasible, limit_ms=None),
            "ttft_p99_ms": 24.0, "stats": {"ttft": {"p99": 24.0}, "tpot": {"p99": tpot_p99_ms}}, "limits": parts,
            "binding": "tpot:p99", "limits_key": TTFT_TPOT.key}


def test_with_two_limits_a_probe_names_the_one_it_missed_by_its_count():
    over = outcome(two_limit_probe(12, "fail", False, 61.0), TTFT_TPOT)
    assert over.kind == OVER and over.words == "failed: 12 of 800 over TPOT P99 50ms, measured 61ms"
    held = outcome(two_limit_probe(3, "pass", True, 44.0), TTFT_TPOT)
    assert held.kind == PASSED
    assert held.words == ("passed: 2 of 800 over TTFT P99 30ms, 3 of 800 over TPOT P99 50ms; TTFT P99 24ms, "
                          "TPOT P99 44ms")
    # re-ranked at the TTFT limit alone, its verdict no longer answers: its TTFT P99 within 30 ms does
    assert outcome(two_limit_probe(12, "fail", False, 61.0), 30.0).words == "passed: TTFT P99 24ms"
    # at a looser TPOT limit than it was judged at (another set of limits), its stored statistics answer
    loose = Limits(items=(TTFT_TPOT.items[0], Limit(metric="tpot", stat="p99", value_ms=70.0)))
    assert outcome(two_limit_probe(12, "fail", False, 61.0), loose).kind == PASSED
    strict = Limits(items=(TTFT_TPOT.items[0], Limit(metric="tpot", stat="p99", value_ms=55.0)))
    assert outcome(two_limit_probe(12, "fail", False, 61.0), strict).words == "failed: TPOT P99 61ms over 55ms"


def test_the_chart_draws_every_probe_on_shared_axes():
    a = Panel("#1", [probe(10.0), probe(20.0, 45.0, over_limit=13, verdict="fail", feasible=False)], probe(10.0))
    b = Panel("#2", [probe(40.0, 90.0, sustained=False, feasible=False)], None, highlight=True)
    axes = Axes.of([a, b], 30.0)
    assert axes.rate_low_rps == 9.0 and axes.latency_low_ms == 20.0 / 1.3 and axes.latency_high_ms == 90.0 * 1.3
    assert axes.x(9.0) < axes.x(20.0) < axes.x(40.0) and axes.y(90.0) < axes.y(30.0) < axes.y(20.0)
    page = chart_html([a, b], 30.0)
    assert page.count("<svg") == 2 and page.count("class='probe ") == 3
    kinds = re.findall(r"class='probe ([a-z-]+)'", page)
    assert kinds == ["passed", "over-the-limit", "fell-behind"]
    assert "<title>20.00 req/s: failed: 13 of 40 over the limit, TTFT P99 45ms</title>" in page
    assert page.count("r='7'") == 1  # the chosen rate's ring, on #1 only
    assert page.count("<figure class=best>") == 1  # #2 highlighted


def test_with_a_tpot_limit_first_the_chart_draws_the_tpot_p99_and_its_limit():
    """The latency axis is the first limit's statistic: a TPOT-first study's panels place each probe at its TPOT
    P99 and draw the TPOT limit, and every probe is judged under both limits."""
    tpot_first = Limits(items=(TTFT_TPOT.items[1], TTFT_TPOT.items[0]))
    a = Panel("#1", [{**two_limit_probe(12, "fail", False, 61.0), "limits_key": tpot_first.key},
                     {**probe(5.0, 20.0), "stats": {"ttft": {"p99": 20.0}, "tpot": {"p99": 30.0}}}])
    axes = Axes.of([a], tpot_first)
    assert axes.latency_low_ms == 30.0 / 1.3 and axes.latency_high_ms == 61.0 * 1.3  # TPOT P99s and the 50 ms limit
    page = chart_html([a], tpot_first)
    assert re.findall(r"class='probe ([a-z-]+)'", page) == ["over-the-limit", "passed"]
    assert "failed: 12 of 800 over TPOT P99 50ms, measured 61ms" in page
    assert "<title>TPOT P99 &lt;= 50ms</title>50ms" in page  # the dashed line is the TPOT limit
