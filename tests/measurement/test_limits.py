"""What limited a replay: hand-checked engine summaries and verdicts; one real-engine check of the stats."""

import asyncio
import math

import pytest

from tests.support.fake_engine import FakeEngine
from optimizer.measurement.engine import EngineStats, ReportsEngineStats, RequestTiming
from optimizer.measurement.limits import diagnose, summarize_engine
from optimizer.search.fitting import cpu_engine_args


def stats(queued_ms, prefill_ms, running_peak=4, max_num_seqs=4, kv=0.3, preemptions=0):
    requests = {i: RequestTiming(q / 1000, p / 1000) for i, (q, p) in enumerate(zip(queued_ms, prefill_ms))}
    return EngineStats(steps=4, running_peak=running_peak, running_sum=10, waiting_peak=3, kv_usage_peak=kv,
                       preemptions=preemptions, max_num_seqs=max_num_seqs, requests=requests)


def test_summary_on_three_requests():
    # queued 0, 100, 300 ms: P50 = 100; P99 = 100 + 0.98 * (300 - 100) = 296 (numpy's linear interpolation)
    s = summarize_engine(stats([0, 100, 300], [10, 20, 40]))
    assert s["requests"] == 3 and s["steps"] == 4 and s["running_mean"] == 2.5 and s["waiting_peak"] == 3
    assert s["queued_p50_ms"] == pytest.approx(100) and s["queued_p99_ms"] == pytest.approx(296)
    assert s["prefill_p50_ms"] == pytest.approx(20) and s["prefill_p99_ms"] == pytest.approx(39.6)
    assert s["max_num_seqs"] == 4 and s["kv_usage_peak"] == 0.3 and s["preemptions"] == 0


def test_summary_without_requests_is_json_safe():
    s = summarize_engine(EngineStats())
    assert s["requests"] == 0 and s["queued_p99_ms"] is None and s["running_mean"] == 0.0
    assert diagnose(s, 100.0) is None and diagnose(None, 100.0) is None


def test_queueing_at_max_num_seqs():
    d = diagnose(summarize_engine(stats([0, 100, 300], [10, 20, 40])), 340.0)
    assert d.label == "max_num_seqs"
    assert d.line == ("limited by max_num_seqs: running peaked at 4/4; TTFT P99 340 ms: queued P99 296 ms, "
                      "prefill P99 40 ms; KV peak 30%, 0 preemptions")


def test_queueing_below_max_num_seqs_is_the_token_budget():
    d = diagnose(summarize_engine(stats([0, 100, 300], [10, 20, 40], running_peak=2)), 340.0)
    assert d.label == "token_budget" and "running peaked at 2/4" in d.line


def test_prefill_dominates():
    d = diagnose(summarize_engine(stats([0, 1, 2], [50, 60, 200], running_peak=1)), 210.0)
    assert d.label == "prefill"


def test_kv_cache_wins_over_everything():
    assert diagnose(summarize_engine(stats([0, 100, 300], [1, 2, 3], preemptions=2)), 310.0).label == "kv_cache"
    assert diagnose(summarize_engine(stats([0, 1, 2], [1, 2, 3], kv=0.97)), 5.0).label == "kv_cache"


def test_time_outside_the_engine():
    # 296 + 40 ms of a 1000 ms TTFT P99: less than half is queueing and prefill
    d = diagnose(summarize_engine(stats([0, 100, 300], [10, 20, 40])), 1000.0)
    assert d.label == "outside_engine"


def test_unknown_ttft_still_names_the_limit():
    d = diagnose(summarize_engine(stats([0, 100, 300], [10, 20, 40])), math.nan)
    assert d.label == "max_num_seqs" and "TTFT P99 n/a" in d.line


def test_engine_stats_is_an_optional_capability():
    assert not isinstance(FakeEngine(), ReportsEngineStats)


@pytest.mark.engine
def test_real_engine_reports_queueing_at_max_num_seqs_1(tiny_model, tmp_path):
    """One CPU engine, max_num_seqs=1, a burst of 10 requests: every request waits for the one before it."""
    from optimizer.core.clock import MonotonicClock
    from optimizer.config.workload_spec import WorkloadSpec
    from optimizer.engines.vllm_engine import VllmEngine
    from optimizer.measurement.metrics import summarize
    from optimizer.measurement.replay import replay
    from optimizer.measurement.workload import build_workload

    work = build_workload(WorkloadSpec(num_requests=10, warmup_requests=1, input_len_min=16, input_len_max=48,
                                       output_len_min=4, output_len_max=8, seed=1), 16000)

    async def scenario():
        engine = VllmEngine({"model": str(tiny_model), **cpu_engine_args()})
        assert isinstance(engine, ReportsEngineStats)
        await engine.start({"max_num_seqs": 1, "gpu_memory_utilization": 0.2}, tmp_path / "e.log")
        try:
            await replay(engine, work.warmup, [0.0] * len(work.warmup), MonotonicClock())
            await engine.take_engine_stats()  # the warm-up is not measured
            records = await replay(engine, work.requests, [0.0] * len(work.requests), MonotonicClock())
            first = await engine.take_engine_stats()
            second = await engine.take_engine_stats()
        finally:
            await engine.shutdown()
        return records, first, second

    records, first, second = asyncio.run(scenario())
    assert sorted(first.requests) == sorted(r.index for r in records)  # keyed by request index
    assert first.max_num_seqs == 1 and first.running_peak == 1 and first.waiting_peak >= 1
    assert first.preemptions == 0 and 0 < first.kv_usage_peak < 1
    assert max(t.queued_s for t in first.requests.values()) > 0.01  # the last ones waited for the others
    assert all(t.prefill_s > 0 for t in first.requests.values())
    assert second.steps == 0 and not second.requests  # taking resets
    summary = summarize_engine(first)
    verdict = diagnose(summary, summarize(records, math.inf).ttft.p99_ms)
    assert verdict is not None and verdict.label in ("max_num_seqs", "outside_engine"), verdict


class StatsFake(FakeEngine):
    """The fake engine with the optional capability: every request it served queued 5 ms and prefilled 1 ms."""

    def __init__(self):
        super().__init__()
        self.served = []

    async def generate(self, request):
        async for n in super().generate(request):
            yield n
        self.served.append(request.index)

    async def take_engine_stats(self):
        out = EngineStats(steps=len(self.served), running_peak=self.max_num_seqs, running_sum=len(self.served),
                          max_num_seqs=self.max_num_seqs, kv_usage_peak=0.25,
                          requests={i: RequestTiming(0.005, 0.001) for i in self.served})
        self.served = []
        return out


def test_a_study_stores_engine_stats_per_replay_and_the_verdict(tmp_path, config_only_model, capsys):
    from optuna.trial import TrialState

    from optimizer.cli.main import main
    from optimizer.config.settings import StudyConfig
    from optimizer.config.workload_spec import WorkloadSpec
    from optimizer.search.runner import prepare, run

    config = StudyConfig(study_name="l", storage_url=f"sqlite:///{tmp_path}/l.db", ttft_p99_ms=30.0, budget=2,
                         model=str(config_only_model), dummy_weights=True, device="cpu",
                         workload=WorkloadSpec(num_requests=20, warmup_requests=2, input_len_min=16,
                                               input_len_max=64, output_len_min=2, output_len_max=4))
    study = run(prepare(config, tmp_path, say=lambda *a: None, engine_factory=StatsFake, memory_probe=lambda: None),
                quiet=True)
    done = study.get_trials(states=(TrialState.COMPLETE,))
    assert done
    for t in done:
        assert t.user_attrs["telemetry"] == {"available": False, "reason": "trials run on cpu: no GPU telemetry"}
        for point in t.user_attrs["curve"]:
            engine = point["engine"]
            assert engine["requests"] == 20  # the warm-up is not in any replay's stats
            assert engine["queued_p99_ms"] == pytest.approx(5) and engine["prefill_p99_ms"] == pytest.approx(1)
        assert t.user_attrs["limited_by"].startswith("limited by ")
    rc = main(["report", "--study", "l", "--storage", config.storage_url, "--trial", str(done[0].number),
               "--studies-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "limited by " in out and "engine_queued_p99_ms" in out
    assert "GPU telemetry: none (trials run on cpu" in out


def test_vllm_stat_logger_calls_accumulate_and_reset():
    """What VllmEngine's stat logger makes of vLLM's SchedulerStats / IterationStats (as plain objects here)."""
    from types import SimpleNamespace as NS

    from optimizer.engines.vllm_engine import _request_index, _StatsSink

    assert _request_index("r12-7") == 12 and _request_index("warm-1") is None
    sink = _StatsSink()
    sink.max_num_seqs = 2
    sched = [NS(num_running_reqs=1, num_waiting_reqs=3, num_skipped_waiting_reqs=1, kv_cache_usage=0.1),
             NS(num_running_reqs=2, num_waiting_reqs=1, num_skipped_waiting_reqs=0, kv_cache_usage=0.4)]
    done = NS(num_preempted_reqs=1, finished_requests=[
        NS(request_id="r3-0", queued_time=0.2, prefill_time=0.01, num_preemptions=1),
        NS(request_id="r4-1", queued_time=-0.0, prefill_time=0.02, num_preemptions=0)])
    sink.record(sched[0], None)
    sink.record(sched[1], done)
    s = sink.take()
    assert (s.steps, s.running_peak, s.running_mean, s.waiting_peak, s.kv_usage_peak) == (2, 2, 1.5, 4, 0.4)
    assert s.preemptions == 1 and s.max_num_seqs == 2 and sorted(s.requests) == [3, 4]
    assert s.requests[3] == RequestTiming(0.2, 0.01, 1)
    assert sink.take().steps == 0
