"""The probe's verdict and the falling-behind criterion, on records built by hand."""

import math

import pytest

from optimizer.measurement.evidence import (
    FAIL, PASS, STEADY_E2E, UNSETTLED, binomial_cdf, count, count_verdict, falls_behind, far_below, looks,
)
from optimizer.measurement.probe_rule import ProbeRule
from optimizer.measurement.metrics import summarize
from tests.support.fakes import request_record


rec = request_record


def steady(n, rate=10.0, ttft=0.05):
    return [rec(i, i / rate, ttft) for i in range(n)]


def test_binomial_cdf_by_hand():
    # n = 2, p = 0.5: P(0) = 1/4, P(<=1) = 3/4
    assert binomial_cdf(0, 2, 0.5) == pytest.approx(0.25)
    assert binomial_cdf(1, 2, 0.5) == pytest.approx(0.75)
    assert binomial_cdf(2, 2, 0.5) == 1.0
    assert binomial_cdf(0, 459, 0.01) == pytest.approx(0.99 ** 459)


def test_looks_double_up_to_the_cap():
    assert looks(1000) == [25, 50, 100, 200, 400, 800, 1000]
    assert looks(120) == [25, 50, 100, 120]


def test_count_verdict_follows_the_binomial_bound():
    alpha = 0.05 / 7
    assert count_verdict(25, 0, alpha) == UNSETTLED  # 0.99^25 = 0.78: 25 clean requests prove nothing
    assert count_verdict(25, 3, alpha) == FAIL  # P(>= 3 of 25 | 1%) = 0.002
    assert count_verdict(800, 0, alpha) == PASS  # 0.99^800 = 0.0003
    assert count_verdict(1000, 10, alpha) == UNSETTLED  # exactly at 1%: the cap comes first
    assert count_verdict(1000, 25, alpha) == FAIL


def test_a_long_final_request_alone_does_not_fail_a_replay():
    # 100 requests at 10 req/s, TTFT 50 ms each; the last one decodes for 20 s after its first token
    records = steady(99) + [rec(99, 9.9, 0.05, decode_s=20.0, tokens=200)]
    m = summarize(records, offered_rate_rps=10.0)
    assert m.achieved_rate_rps < 0.9 * m.sent_rate_rps  # the old completion-ratio check would have failed it
    assert not falls_behind(records)
    assert m.sustained


def test_a_queue_that_grows_falls_behind():
    # sends at 10 req/s, first tokens at only 5 per second: the backlog grows by half of what is sent
    records = [rec(i, i / 10.0, i / 5.0 - i / 10.0 + 0.05) for i in range(100)]
    assert falls_behind(records)
    assert not summarize(records, offered_rate_rps=10.0).sustained


def test_a_queue_that_keeps_pace_with_slow_first_tokens_does_not():
    # every first token 400 ms after its send: a constant backlog of 4, not a growing one
    assert not falls_behind(steady(100, ttft=0.4))


def test_count_reads_only_what_is_known_at_the_time():
    records = [rec(0, 0.0, 0.05), rec(1, 0.1, 0.5), rec(2, 0.2, None)]
    c = count(records, now_s=0.3, limit_ms=150.0)
    # #0 within (50 ms); #1 no first token by 0.3 but waited 200 ms > 150: over; #2 waited 100 ms: pending
    assert (c.resolved, c.over, c.pending) == (2, 1, 1)


def test_far_below_the_limit_a_probe_stops_after_a_few_dozen():
    rule = ProbeRule(150.0, cap=1000)
    records = [rec(i, i / 10.0, 0.02 + 0.0002 * (i * 37 % 60)) for i in range(60)]  # TTFTs of 20-32 ms
    stops = [n for n in range(1, 61) if rule(records[:n], records[n - 1].sent_s + 0.001)]
    assert stops and stops[0] <= 55
    ev = rule.evidence(records[:stops[0]])
    assert ev.verdict == PASS and ev.far


def test_a_queue_growing_past_capacity_is_not_passed_far_below_before_it_could_show():
    # 131 req/s into an engine 10% short of it: each first token 25 ms plus the queue's 10% of the time sent (a real
    # trial passed such a probe after 52 requests). After 52 the slowest is 64 ms, far below 150 by its tail, and
    # the batch has turned over 5 times; but 0.39 s of sending bound the drift to no better than 16%. No pass until
    # the queue could have shown, and by then it has: the probe fails
    rate = 131.0
    records = [rec(i, i / rate, 0.025 + 0.1 * i / rate, decode_s=0.01, tokens=2) for i in range(400)]
    c = count(records[:52], records[51].sent_s + 0.1, 150.0)
    assert c.resolved == 52 and far_below(c.values_ms, 150.0) and c.sending_s >= STEADY_E2E * c.longest_e2e_s
    assert not c.steady
    rule = ProbeRule(150.0, cap=1000)
    stops = [n for n in range(1, 401) if rule(records[:n], records[n - 1].sent_s + 0.1)]
    assert stops and rule.evidence(records[:stops[0]]).verdict == FAIL
    # the same engine within its capacity (no queue growing): passed far below, once sent for 20 x its slowest
    calm = [rec(i, i / rate, 0.025 + 0.00005 * (i * 37 % 60), decode_s=0.01, tokens=2) for i in range(400)]
    rule = ProbeRule(150.0, cap=1000)
    stops = [n for n in range(1, 401) if rule(calm[:n], calm[n - 1].sent_s + 0.1)]
    ev = rule.evidence(calm[:stops[0]])
    assert ev.verdict == PASS and ev.far and stops[0] / rate >= 20 * 0.028


def test_a_rare_spike_is_not_extrapolated_away():
    # 1 in 100 over the limit, the rest all alike: no tail to fit, so 50 clean requests cannot pass it "far below"
    rule = ProbeRule(150.0, cap=1000)
    assert not rule(steady(50), 5.5)


def test_far_above_the_limit_a_probe_fails_at_the_first_look():
    rule = ProbeRule(150.0, cap=1000)
    records = steady(30, ttft=0.3)
    assert rule(records[:26], 30.0)
    assert rule.evidence(records[:26]).verdict == FAIL


def test_near_the_limit_a_probe_runs_to_its_cap_unsettled():
    rule = ProbeRule(150.0, cap=400)
    # 1 in 100 over the limit: exactly P99 = the limit
    records = [rec(i, i / 10.0, 0.3 if i % 100 == 50 else 0.05) for i in range(400)]
    assert not any(rule(records[:n], records[n - 1].sent_s + 1.0) for n in range(1, 401))
    ev = rule.evidence(records)
    assert ev.verdict == UNSETTLED and ev.requests == 400 and ev.over_limit == 4
    assert ev.passes  # at the cap, the share over (1%) is the best guess
    assert not math.isnan(ev.over_share)


def test_overs_in_one_burst_count_as_one_cluster():
    # 200 requests; overs at 10, 11, 12 (one burst) and at 100 (alone): 4 over, 2 clusters
    over_at = {10, 11, 12, 100}
    records = [rec(i, i / 10.0, 0.3 if i in over_at else 0.05) for i in range(200)]
    c = count(records, 100.0, 150.0)
    assert (c.over, c.clusters) == (4, 2) and c.independent_fraction == pytest.approx(0.5)


def test_a_burst_of_overs_early_does_not_settle_a_fail_alone():
    # 4 overs in a row among the first 25: as requests they fail the first look, as one cluster they do not
    records = [rec(i, i / 10.0, 0.3 if i in (5, 6, 7, 8) else 0.05) for i in range(30)]
    rule = ProbeRule(150.0, cap=1000)
    assert not rule(records[:26], 30.0)
    assert count_verdict(25, 4, 0.05 / 7) == FAIL


def test_requests_withdrawn_when_a_probe_stops_count_only_past_the_limit():
    from optimizer.measurement.replay import WITHDRAWN, withdraw

    rule = ProbeRule(150.0, cap=1000)
    records = steady(30, ttft=0.3)  # every request far over the limit: the first look fails it
    now = records[25].sent_s + 1.0
    assert rule(records[:26], now)
    late, fresh = rec(26, now - 0.2, None), rec(27, now - 0.05, None)
    for r in (late, fresh):
        withdraw(r)
    kept = rule.kept(records[:26] + [late, fresh], WITHDRAWN)
    assert late in kept and fresh not in kept  # waited 200 ms (over) / 50 ms (never judged)
    assert count(kept, math.inf, 150.0).over == 27
