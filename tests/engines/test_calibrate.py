"""Calibration: the observation extraction by hand, the fit on exact data, and the whole loop on a known engine."""

import asyncio
import math

import pytest

from optimizer.config.model import DEFAULT_MODEL_CONFIG, model_info
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.engines.sim.calibrate import (
    Observation, ValidationPoint, calibrate, decode_observations, fit, prefill_observations, relative_error,
)
from optimizer.engines.sim.steptime import StepTimeModel
from optimizer.engines.simulated import SimulatedEngine
from optimizer.measurement.metrics import RequestRecord
from optimizer.measurement.workload import build_workload

TRUE = StepTimeModel(fixed_s=0.005, prefill_token_s=1e-4, decode_seq_s=4e-4, context_token_s=1e-6,
                     prefill_attention_s=1.5e-7, request_s=0.004)


def rec(index, input_len, sent, chunks):
    return RequestRecord(index=index, input_len=input_len, planned_s=sent, sent_s=sent, first_token_s=chunks[0],
                         chunk_times_s=list(chunks), output_tokens=len(chunks), ok=True)


def test_prefill_observation_is_the_ttft_of_a_lone_request():
    [o] = prefill_observations([rec(0, 100, 1.0, [1.25, 1.3])], "p")
    assert (o.prefill_tokens, o.decode_seqs, o.step_s, o.prefill_attention, o.new_requests) == \
        (100, 0, pytest.approx(0.25), 5000, 1)


def test_decode_observation_uses_only_gaps_while_all_decode():
    # both have their first token by t=2; the first to finish does at t=5: gaps inside [2, 5] only
    a = rec(0, 10, 0.0, [1.0, 2.0, 3.0, 4.0, 5.0])
    b = rec(1, 10, 0.0, [2.0, 3.5, 5.0, 6.0])
    [o] = decode_observations([a, b], "d")
    # gaps inside: a 2->3, 3->4, 4->5 (1 s each), b 2->3.5, 3.5->5 (1.5 s): median 1.0
    assert o.decode_seqs == 2 and o.step_s == pytest.approx(1.0)
    # contexts of those gaps: a 10+2, 10+3, 10+4; b 10+1, 10+2 -> median 12, times 2 sequences
    assert o.context_tokens == 24
    failed = RequestRecord(index=2, input_len=10, planned_s=0, sent_s=0)
    assert decode_observations([a, b, failed], "d") == []  # a failed request spoils the batch


def test_fit_recovers_exact_coefficients():
    obs = []
    for n in (16, 64, 256, 768, 1536):
        obs.append(Observation(n, 0, 0, TRUE.step_s(n, 0, 0, n * n / 2, 1), "p", n * n / 2, 1))
    for seqs, ctx in ((1, 20), (4, 80), (16, 400), (48, 1500), (4, 4200)):
        obs.append(Observation(0, seqs, ctx, TRUE.step_s(0, seqs, ctx), "d"))
    got = fit(obs, 17.0, 4.0)
    for name in ("fixed_s", "prefill_token_s", "decode_seq_s", "context_token_s", "prefill_attention_s",
                 "request_s"):
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert (got.engine_start_s, got.engine_shutdown_s) == (17.0, 4.0)


def test_fit_never_returns_a_negative_coefficient():
    # step time falls with context here (noise): a plain least-squares fit would give it a negative cost
    obs = [Observation(0, 1, 100, 0.010, "d"), Observation(0, 1, 1000, 0.009, "d"),
           Observation(0, 8, 800, 0.014, "d"), Observation(50, 0, 0, 0.02, "p", 1250, 1)]
    got = fit(obs, 1, 1)
    assert all(v >= 0 for v in got.to_dict().values())


def test_relative_error_and_validation_point():
    assert relative_error(110, 100) == pytest.approx(0.1)
    assert math.isnan(relative_error(1, 0)) and math.isnan(relative_error(math.nan, 5))
    p = ValidationPoint({}, math.inf, [190, 210], [90, 110], 190, 130)
    assert p.throughput_error == pytest.approx(-0.05) and p.ttft_p99_error == pytest.approx(0.3)
    assert p.real_throughput_spread == pytest.approx(0.1) and p.real_ttft_p99_spread == pytest.approx(0.2)
    assert p.to_dict()["rate_rps"] is None


def test_calibration_recovers_a_known_engine_and_predicts_it():
    """The whole loop with a simulated engine as 'the real one': the fit finds its model, validation shows ~0 error."""
    info = model_info(DEFAULT_MODEL_CONFIG, "sim")
    workload = build_workload(WorkloadSpec(num_requests=60, input_len_min=32, input_len_max=256,
                                           output_len_min=16, output_len_max=64), info.vocab_size)
    result = asyncio.run(calibrate(lambda: SimulatedEngine(info, TRUE), lambda m: SimulatedEngine(info, m),
                                   workload, info.max_len, clock=None, repeats=1))
    assert result.model.prefill_token_s == pytest.approx(TRUE.prefill_token_s, rel=0.1)
    assert result.model.decode_seq_s == pytest.approx(TRUE.decode_seq_s, rel=0.1)
    assert len(result.validation) == 9  # 3 held-out configs x (burst + 2 rates)
    assert result.median_abs_error("throughput_error") < 0.02
    assert result.median_abs_error("ttft_p99_error") < 0.05


@pytest.mark.engine
def test_calibrate_on_the_real_cpu_engine(tmp_path, tiny_model, model_cache):
    """`optimize calibrate` as a user runs it: probes, fit, one held-out config, a JSON the simulator reads."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO, subprocess_env

    out = tmp_path / "cal.json"
    proc = subprocess.run([sys.executable, "-m", "optimizer", "calibrate", "--out", str(out), "--repeats", "1",
                           "--validate", "1", "--num-requests", "40"], cwd=REPO, env=subprocess_env(model_cache),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "median |error| output throughput" in proc.stdout
    data = json.loads(out.read_text())
    model = StepTimeModel.load(out)
    assert model.decode_seq_s > 0 and model.prefill_token_s > 0 and model.engine_start_s > 1
    assert len(data["validation"]) == 3  # the burst and two Poisson rates of one held-out config
    # throughput under load is set by the step times: a fitted model that is far off would miss by much more
    assert data["median_abs_error"]["output_throughput"] < 0.3
    assert (tmp_path / "cal.log").stat().st_size > 0  # the engines' own output went to the log, not the terminal
