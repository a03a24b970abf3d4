"""`vllm bench serve --save-result` JSON from a real replay's summary: ITL and E2E P99 under vLLM's names, and the
prompt tokens of the completed requests also when a request failed (hand-computed on four made-up requests)."""

import json

import numpy as np
import pytest

from optimizer.cli.main import main
from optimizer.config.limits import Limit, Limits
from optimizer.config.model import DEMO_LADDER, is_demo_model
from optimizer.core.errors import OptimizerError
from optimizer.decision.benchjson import bench_result, chosen_point
from optimizer.measurement.metrics import RequestRecord, summarize
from optimizer.measurement.rate_search import CurvePoint
from optimizer.search.attrs import STUDY_CONFIG
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
    return CurvePoint.of(summarize(records, offered_rate_rps=1.0), Limits.ttft_p99(1000.0)).to_dict()


def test_itl_and_e2el_p99_are_written_under_vllms_names(tmp_path, replay):
    study, config = synthetic.build(tmp_path)
    result = bench_result(study.trials[2], config, replay, Limits.ttft_p99(1000.0))
    assert result["p99_itl_ms"] == pytest.approx(float(np.percentile([100, 100, 300, 100, 100, 100], 99)))
    assert result["p99_e2el_ms"] == pytest.approx(float(np.percentile([300, 500, 700], 99)))


def test_total_input_tokens_counts_the_completed_prompts_when_a_request_failed(tmp_path, replay):
    study, config = synthetic.build(tmp_path)
    result = bench_result(study.trials[2], config, replay, Limits.ttft_p99(1000.0))
    assert result["failed"] == 1 and result["completed"] == 3
    assert result["total_input_tokens"] == 600  # 100 + 200 + 300, as vLLM's calculate_metrics counts them
    duration_s = 3 / result["request_throughput"]
    assert result["total_token_throughput"] == pytest.approx(600 / duration_s + result["output_throughput"])


@pytest.mark.parametrize("shape", [s.name for s in DEMO_LADDER])
def test_the_model_is_the_demo_shape_the_study_ran(tmp_path, capsys, shape):
    """A demo study stores the shape its probe chose (e.g. tiny-llama-7m); the JSON names that one, not the largest
    shape the probe starts from."""
    study, config = synthetic.build(tmp_path)
    STUDY_CONFIG.set(study, config.model_copy(update={"model": shape, "model_is_default": True}).model_dump_json())
    path = tmp_path / "best.json"
    code = main(["report", "--study", "syn", "--studies-dir", str(tmp_path), "--bench-json", str(path)])
    assert code == 0, capsys.readouterr().err
    result = json.loads(path.read_text())
    assert result["model_id"] == shape and result["tokenizer_id"] == shape


def test_a_local_model_is_named_by_its_path(tmp_path):
    study, config = synthetic.build(tmp_path)
    point = chosen_point(study.trials[2], config.limits)
    assert bench_result(study.trials[2], config, point, config.limits)["model_id"] == config.model


def test_the_json_names_every_limit_the_config_was_tuned_for(tmp_path):
    """Judged at TTFT P99 and TPOT P99 limits, the JSON names both; a trial with no replay within both says which
    limits it missed."""
    study, config = synthetic.build(tmp_path)
    limits = Limits(items=(Limit(metric="ttft", stat="p99", value_ms=100), Limit(metric="tpot", stat="p99",
                                                                                  value_ms=50)))
    point = chosen_point(study.trials[2], limits)  # the synthetic points' TPOT P99 is 5 ms: #2's 7.7 req/s holds
    result = bench_result(study.trials[2], config, point, limits)
    assert result["optimizer_slo"] == "TTFT P99 <= 100ms, TPOT P99 <= 50ms"
    assert result["optimizer_limits"]["items"] == [{"metric": "ttft", "stat": "p99", "value_ms": 100.0},
                                                   {"metric": "tpot", "stat": "p99", "value_ms": 50.0}]
    assert result["request_rate"] == 7.7
    strict = Limits(items=(*limits.items[:1], Limit(metric="tpot", stat="p99", value_ms=4)))
    with pytest.raises(OptimizerError, match=r"meets TTFT P99 <= 100ms, TPOT P99 <= 4.0ms: .*--tpot-p99 4ms"):
        chosen_point(study.trials[2], strict)


@pytest.mark.parametrize("root, demo", [("/home/u/.cache/optimizer/models/tiny-llama-7m/", True),
                                        ("tiny-llama-4m", True), ("/models/llama-3-8b", False),
                                        ("/models/not-tiny-llama-7m", False)])
def test_a_served_demo_model_is_recognised_whichever_shape(root, demo):
    """`optimize measure` replays the CPU demo's workload against a server of any embedded shape."""
    assert is_demo_model(root) is demo
