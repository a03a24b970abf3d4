"""Metric formulas on three made-up requests whose numbers are computed by hand."""

import math

import numpy as np
import pytest

from optimizer.measurement.metrics import RequestRecord, summarize


def rec(i, sent, chunks, input_len=10, ok=True):
    r = RequestRecord(index=i, input_len=input_len, planned_s=sent, sent_s=sent)
    if chunks:
        r.first_token_s = chunks[0]
        r.chunk_times_s = list(chunks)
        r.output_tokens = len(chunks)
    r.ok = ok
    return r


@pytest.fixture
def three():
    # request 0: sent 0.0, tokens at 0.1 0.2 0.3   -> ttft 100 ms, e2e 300 ms, tpot (300-100)/2 = 100 ms
    # request 1: sent 1.0, tokens at 1.2 1.5        -> ttft 200 ms, e2e 500 ms, tpot 300 ms
    # request 2: sent 2.0, tokens at 2.4 2.5 2.6 2.7 -> ttft 400 ms, e2e 700 ms, tpot 100 ms
    return [rec(0, 0.0, [0.1, 0.2, 0.3]), rec(1, 1.0, [1.2, 1.5]), rec(2, 2.0, [2.4, 2.5, 2.6, 2.7])]


def test_ttft_tpot_itl_e2e(three):
    m = summarize(three, offered_rate_rps=1.0)
    assert m.ttft.mean_ms == pytest.approx((100 + 200 + 400) / 3)
    assert m.ttft.p50_ms == pytest.approx(200)
    assert m.ttft.p99_ms == pytest.approx(200 + 0.98 * 200)  # linear interpolation between 200 and 400
    assert m.tpot.p50_ms == pytest.approx(100)
    assert m.tpot.mean_ms == pytest.approx(500 / 3)
    # ITL pools every gap: 100,100 | 300 | 100,100,100
    assert m.itl.mean_ms == pytest.approx(800 / 6)
    assert m.e2e.p50_ms == pytest.approx(500)


def test_throughputs_use_first_send_to_last_finish(three):
    m = summarize(three, offered_rate_rps=1.0)
    assert m.duration_s == pytest.approx(2.7)
    assert m.completed == 3 and m.failed == 0
    assert m.request_throughput_rps == pytest.approx(3 / 2.7)
    assert m.output_throughput_tok_s == pytest.approx(9 / 2.7)
    assert m.total_token_throughput_tok_s == pytest.approx(39 / 2.7)
    # completions: 0.3 .. 2.7 -> 2 gaps over 2.4 s; sends: 0 .. 2 -> 2 gaps over 2 s
    assert m.achieved_rate_rps == pytest.approx(2 / 2.4)
    assert m.sent_rate_rps == pytest.approx(1.0)
    assert m.sustained  # three requests: too few to call a backlog growing


def test_failed_requests_count_only_as_failed(three):
    three.append(rec(3, 2.5, [], ok=False))
    m = summarize(three, offered_rate_rps=1.0)
    assert m.failed == 1 and m.completed == 3
    assert m.ttft.p50_ms == pytest.approx(200)
    assert not m.sustained  # a replay with errors is never counted as sustained


def test_burst_is_sustained_by_definition():
    records = [rec(i, 0.0, [0.1 * (i + 1), 0.1 * (i + 2)]) for i in range(5)]
    m = summarize(records, offered_rate_rps=math.inf)
    assert m.sustained


def test_percentiles_match_numpy():
    records = [rec(i, float(i), [i + 0.001 * (i + 1)]) for i in range(200)]
    m = summarize(records, offered_rate_rps=1.0)
    ttfts = [(i + 1) for i in range(200)]
    assert m.ttft.p99_ms == pytest.approx(float(np.percentile(ttfts, 99)))
    assert math.isnan(m.tpot.p50_ms)  # single-token outputs have no TPOT


def test_empty_replay():
    m = summarize([], offered_rate_rps=1.0)
    assert m.completed == 0 and m.output_throughput_tok_s == 0.0 and not m.sustained
