"""Each probe judged under the report's limit (decision/probes.py), on hand-made points: passed, or which of the three
reasons failed it; and the chart draws one marker per probe on axes shared by every panel."""

import re

from optimizer.decision.probes import BEHIND, OVER, PASSED, WITHDRAWN, Axes, Panel, chart_html, outcome


def probe(rate_rps=10.0, ttft_p99_ms=20.0, requests=40, over_limit=0, verdict="pass", sustained=True, completed=40,
          failed=0, feasible=True, limit_ms=30.0):
    """A probe sized by evidence, judged at `limit_ms`, as the curve stores it."""
    return {"offered_rate_rps": rate_rps, "ttft_p99_ms": ttft_p99_ms, "requests": requests, "over_limit": over_limit,
            "verdict": verdict, "sustained": sustained, "completed": completed, "failed": failed,
            "feasible": feasible, "limit_ms": limit_ms, "output_throughput_tok_s": 100.0}


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
    tpot = outcome({**probe(), "tpot_p99_ms": 60.0}, 30.0, {"tpot_p99_ms": 50.0})
    assert tpot.kind == OVER and tpot.words.endswith("TPOT P99 60ms over 50ms")


def test_the_chart_draws_every_probe_on_shared_axes():
    a = Panel("#1", [probe(10.0), probe(20.0, 45.0, over_limit=13, verdict="fail", feasible=False)], probe(10.0))
    b = Panel("#2", [probe(40.0, 90.0, sustained=False, feasible=False)], None, highlight=True)
    axes = Axes.of([a, b], 30.0)
    assert axes.rate_low_rps == 9.0 and axes.ttft_low_ms == 20.0 / 1.3 and axes.ttft_high_ms == 90.0 * 1.3
    assert axes.x(9.0) < axes.x(20.0) < axes.x(40.0) and axes.y(90.0) < axes.y(30.0) < axes.y(20.0)
    page = chart_html([a, b], 30.0)
    assert page.count("<svg") == 2 and page.count("class='probe ") == 3
    kinds = re.findall(r"class='probe ([a-z-]+)'", page)
    assert kinds == ["passed", "over-the-limit", "fell-behind"]
    assert "<title>20.00 req/s: failed: 13 of 40 over the limit, TTFT P99 45ms</title>" in page
    assert page.count("r='7'") == 1  # the chosen rate's ring, on #1 only
    assert page.count("<figure class=best>") == 1  # #2 highlighted
