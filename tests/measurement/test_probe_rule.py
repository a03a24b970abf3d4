"""A probe's joint verdict on every limit, and what each metric counts, on records built by hand."""

import math

import numpy as np
import pytest

from optimizer.config.limits import parse_limits
from optimizer.measurement.evidence import FAIL, PASS, count
from optimizer.measurement.limit_counts import MeanTest, count_goodput, count_itl, count_request_metric, statistic_ms
from optimizer.measurement.metrics import summarize
from optimizer.measurement.probe_rule import ProbeRule
from tests.support.fakes import request_record

rec = request_record


def probe(rule, records):
    """Replays `records` through `rule` as a live replay would ask it, send by send; the evidence at the end."""
    for k in range(1, len(records) + 1):
        if rule(records[:k], records[k - 1].sent_s):
            records = records[:k]
            break
    return rule.evidence(records)


def test_tpot_of_a_finished_request_by_hand():
    # sent at 0, first token at 0.05, 5 tokens over 0.1 s: E2E 0.15 s, TPOT (0.15 - 0.05) / 4 = 25 ms
    r = rec(0, 0.0, 0.05, decode_s=0.1, tokens=5)
    c = count_request_metric([r], math.inf, "tpot", 20.0)
    assert c.resolved == 1 and c.over == 1 and c.values_ms == pytest.approx((25.0,))
    assert count_request_metric([r], math.inf, "tpot", 30.0).over == 0
    # before its last token it is pending; a one-token request has no TPOT (as in vLLM): never counted
    assert count_request_metric([r], 0.1, "tpot", 20.0).pending == 1
    one = rec(1, 0.0, 0.05, tokens=1)
    assert count_request_metric([one], math.inf, "tpot", 20.0).resolved == 0


def test_e2e_is_over_once_a_request_has_waited_past_the_limit():
    r = rec(0, 0.0, 0.05, decode_s=1.0)  # last token at 1.05 s
    assert count_request_metric([r], 0.5, "e2e", 400.0).over == 1  # still running at 0.5 s, past 400 ms
    assert count_request_metric([r], 0.3, "e2e", 400.0).pending == 1
    done = count_request_metric([r], math.inf, "e2e", 2000.0)
    assert done.over == 0 and done.values_ms == pytest.approx((1050.0,))


def test_itl_counts_gaps_and_a_late_chunk():
    r = rec(0, 0.0, 0.05, decode_s=0.3, tokens=4)  # gaps of 100 ms
    c = count_itl([r], math.inf, 50.0)
    assert (c.resolved, c.over, c.clusters) == (3, 3, 1)
    assert count_itl([r], math.inf, 150.0).over == 0
    # a stall: chunks at 0.05, 0.15, then 0.60; at 0.40 s the next chunk is 250 ms late already: a gap over 120 ms
    stalled = rec(1, 0.0, 0.05)
    stalled.chunk_times_s = [0.05, 0.15, 0.60]
    live = count_itl([stalled], 0.40, 120.0)
    assert (live.resolved, live.over) == (2, 1)


def test_goodput_counts_a_request_over_when_it_misses_any_limit():
    limits = parse_limits(slo=["ttft=100ms", "tpot=30ms"], goodput="99%")
    fast = rec(0, 0.0, 0.05, decode_s=0.1)  # TTFT 50 ms, TPOT 25 ms: good
    slow_decode = rec(1, 0.0, 0.05, decode_s=0.2)  # TPOT 50 ms: bad
    slow_first = rec(2, 0.0, 0.2)  # TTFT 200 ms: bad as soon as it is known
    c = count_goodput([fast, slow_decode, slow_first], math.inf, limits)
    assert (c.resolved, c.over, c.over_indices) == (3, 2, (1, 2))
    # at 0.15 s: the first is still decoding (pending), the third has waited past 100 ms for its first token
    early = count_goodput([fast, slow_decode, slow_first], 0.12, limits)
    assert (early.resolved, early.over, early.pending) == (1, 1, 2)


def test_statistics_are_numpys_linear_percentiles_as_vllms():
    values = [float(v) for v in np.random.default_rng(3).exponential(40.0, 777)]
    for stat, q in (("p50", 50), ("p90", 90), ("p99", 99), ("p99.9", 99.9), ("p97.5", 97.5)):
        assert statistic_ms(values, stat) == pytest.approx(float(np.percentile(values, q)))
    assert statistic_ms(values, "mean") == pytest.approx(float(np.mean(values)))
    assert math.isnan(statistic_ms([], "p99"))


def test_the_mean_test_by_hand():
    # 100 values, mean 10, sd 1: the 95% one-sided bound is 10 + 1.645 x 0.1
    values = [9.0, 11.0] * 50
    t = MeanTest.of(values, 0.05)
    assert t.mean_ms == 10.0 and t.half_width_ms == pytest.approx(1.6449 * (100 / 99) ** 0.5 / 10, rel=1e-3)
    assert t.passes(10.2) and not t.passes(10.1) and t.fails(9.8) and not t.fails(9.9)


def steady(n, rate, ttft, decode_s, tokens=5):
    return [rec(i, i / rate, ttft, decode_s, tokens) for i in range(n)]


def test_one_ttft_limit_reads_exactly_as_the_single_limit_rule():
    records = steady(600, 20.0, 0.05, 0.1)
    one, same = ProbeRule(150.0, 1000), ProbeRule(parse_limits("150ms"), 1000)
    a, b = probe(one, records), probe(same, records)
    assert a == b and a.verdict == PASS and a.binding == "ttft:p99"


def test_a_tpot_limit_fails_a_probe_whose_first_tokens_are_fast():
    # TTFT 50 ms (far within 150), TPOT 50 ms a token over a 30 ms limit: every request over it
    records = steady(600, 20.0, 0.05, 0.2)
    ev = probe(ProbeRule(parse_limits("150ms", "30ms"), 1000), records)
    assert ev.verdict == FAIL and ev.binding == "tpot:p99"
    parts = {p.key: p for p in ev.limits}
    assert parts["tpot:p99"].over_limit == parts["tpot:p99"].requests > 0 and parts["ttft:p99"].over_limit == 0
    assert parts["tpot:p99"].value_ms == pytest.approx(50.0)
    # the same records under TTFT alone pass
    assert probe(ProbeRule(150.0, 1000), steady(600, 20.0, 0.05, 0.2)).verdict == PASS


def test_a_joint_pass_needs_every_limit_to_pass():
    # TPOT 25 ms against 26 ms: every request within, but the count needs as many requests as any P99 pass does
    records = steady(1000, 20.0, 0.05, 0.1)
    ev = probe(ProbeRule(parse_limits("150ms", "26ms"), 1000), records)
    assert ev.verdict == PASS and {p.key for p in ev.limits} == {"ttft:p99", "tpot:p99"}
    assert all(p.verdict == PASS or p.far for p in ev.limits)
    # 3% of requests slow to stream: TPOT P99 fails while TTFT passes; the probe fails on TPOT
    slow = [rec(i, i / 20.0, 0.05, 0.2 if i % 33 == 0 else 0.1) for i in range(1000)]
    ev = probe(ProbeRule(parse_limits("150ms", "30ms"), 1000), slow)
    assert ev.verdict == FAIL and ev.binding == "tpot:p99"


def test_a_percentile_other_than_p99_allows_its_own_share():
    # 5% of requests stream slowly: P90 holds (10% allowed), P99 does not
    slow = [rec(i, i / 20.0, 0.05, 0.2 if i % 20 == 0 else 0.1) for i in range(1000)]
    p90 = probe(ProbeRule(parse_limits(slo=["tpot:p90=30ms"]), 1000), slow)
    p99 = probe(ProbeRule(parse_limits(slo=["tpot:p99=30ms"]), 1000), slow)
    assert p90.verdict == PASS and p99.verdict == FAIL


def test_the_probe_stops_waiting_on_the_shortest_ttft_or_e2e_limit():
    rule = ProbeRule(parse_limits("500ms", e2e_p99="300ms"), 1000)
    assert rule.waiting_limit_s == pytest.approx(0.3)
    assert ProbeRule(parse_limits(tpot_p99="30ms"), 1000).waiting_limit_s == math.inf


def test_count_is_unchanged_for_ttft():
    records = steady(100, 20.0, 0.05, 0.1)
    assert count_request_metric(records, 2.0, "ttft", 150.0) == count(records, 2.0, 150.0)


def test_stored_statistics_agree_with_the_summary():
    records = steady(200, 20.0, 0.05, 0.1)
    m = summarize(records, 20.0)
    assert m.tpot.stat_ms("p99") == pytest.approx(25.0) and m.ttft.stat_ms("p99.9") == pytest.approx(50.0)
    assert math.isnan(m.tpot.stat_ms("p97.5"))  # not a summary statistic: the probe's own count holds it
