"""`vllm bench serve --save-result` JSON from a real replay's summary: ITL and E2E P99 under vLLM's names, and the
prompt tokens of the completed requests also when a request failed (hand-computed on four made-up requests)."""

import numpy as np
import pytest

from optimizer.decision.benchjson import bench_result
from optimizer.measurement.metrics import RequestRecord, summarize
from optimizer.measurement.rate_search import CurvePoint
from tests.support import synthetic


def rec(i, sent, chunks, input_len, ok=True):
    r = RequestRecord(index=i, input_len=input_len, planned_s=sent, sent_s=sent)
    if ok:
        r.first_token_s, r.chunk_times_s, r.output_tokens, r.ok = chunks[0], list(chunks), len(chunks), True
    else:
        r.error = "connection reset"
    return r


@pytest.fixture
def replay():
    # three complete (prompts 100, 200, 300 tokens), one failed (prompt 1000 tokens: never counted)
    # ITL gaps: 0.1, 0.1 | 0.3 | 0.1, 0.1, 0.1; E2E: 0.3, 0.5, 0.7 s
    records = [rec(0, 0.0, [0.1, 0.2, 0.3], 100), rec(1, 1.0, [1.2, 1.5], 200),
               rec(2, 2.0, [2.4, 2.5, 2.6, 2.7], 300), rec(3, 2.5, [], 1000, ok=False)]
    return CurvePoint.of(summarize(records, offered_rate_rps=1.0), limit_ms=1000.0).to_dict()


def test_itl_and_e2el_p99_are_written_under_vllms_names(tmp_path, replay):
    study, config = synthetic.build(tmp_path)
    result = bench_result(study.trials[2], config, replay, 1000.0)
    assert result["p99_itl_ms"] == pytest.approx(float(np.percentile([100, 100, 300, 100, 100, 100], 99)))
    assert result["p99_e2el_ms"] == pytest.approx(float(np.percentile([300, 500, 700], 99)))


def test_total_input_tokens_counts_the_completed_prompts_when_a_request_failed(tmp_path, replay):
    study, config = synthetic.build(tmp_path)
    result = bench_result(study.trials[2], config, replay, 1000.0)
    assert result["failed"] == 1 and result["completed"] == 3
    assert result["total_input_tokens"] == 600  # 100 + 200 + 300, as vLLM's calculate_metrics counts them
    duration_s = 3 / result["request_throughput"]
    assert result["total_token_throughput"] == pytest.approx(600 / duration_s + result["output_throughput"])
