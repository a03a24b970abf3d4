"""The warm-up under load (search/probes.py): before a trial's first probe, the first `warmup_load_requests` measured
requests at the rate that probe goes to, measured nowhere; past the engine's capacity it stops as a failing probe
does. On the fake engine, in real time."""

import asyncio
import time

from optimizer.config.workload_spec import WorkloadSpec
from optimizer.core.clock import MonotonicClock
from tests.support.fake_engine import FakeEngine
from optimizer.measurement.workload import build_workload
from optimizer.search.probes import TrialReplays
from tests.support.fakes import make_config


class Recording(FakeEngine):
    """The fake engine, keeping each request's index and when it was sent."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.sent = []

    async def generate(self, request):
        self.sent.append((request.index, time.monotonic()))
        async for n in super().generate(request):
            yield n


def trial(tmp_path, engine, warm, num_requests=60):
    config = make_config(tmp_path, tmp_path, workload=WorkloadSpec(
        num_requests=num_requests, warmup_requests=2, warmup_load_requests=warm, input_len_min=16, input_len_max=64,
        output_len_min=2, output_len_max=6), search={"max_replays": 2})  # two probes: enough to see the first
    return TrialReplays(engine, build_workload(config.workload, 1000), config, MonotonicClock(), None, 0, [])


def run(engine, params, work):
    async def main():
        await engine.start(params)
        try:
            return await work()
        finally:
            await engine.shutdown()
    return asyncio.run(main())


def test_the_first_probe_comes_after_the_warm_up_at_its_rate(tmp_path):
    engine = Recording(step_s=0.002)
    replays = trial(tmp_path, engine, warm=30)
    result = run(engine, {"max_num_seqs": 8}, lambda: replays.measure(incumbent_rate_rps=100.0))
    indices = [i for i, _ in engine.sent]
    # the 2 warm-up requests (drawn apart: indices past the measured ones), then the first 30 measured ones, then
    # the first probe, which starts again from the first measured request
    assert indices[:2] == [60, 61] and indices[2:32] == list(range(30)) and indices[32] == 0
    # sent at the first probe's rate: request 29 goes out at its arrival at 100 req/s after request 0
    expected_s = replays.workload.arrivals_s(100.0)[29]
    took_s = engine.sent[31][1] - engine.sent[2][1]
    assert expected_s * 0.95 <= took_s <= expected_s + 0.5, (took_s, expected_s)
    # in no curve: the first probe is at the incumbent's rate, and each replay of the trial is a probe of it
    assert result.points[0].offered_rate_rps == 100.0
    assert len(replays.engine_points) == len(result.points) == replays.replays
    # 0 leaves it out
    engine = Recording(step_s=0.002)
    run(engine, {"max_num_seqs": 8}, lambda: trial(tmp_path, engine, warm=0).measure(incumbent_rate_rps=100.0))
    assert [i for i, _ in engine.sent][:3] == [60, 61, 0]


def test_past_the_engines_capacity_the_warm_up_stops_as_a_failing_probe_would(tmp_path):
    # one sequence at a time, ~10-30 ms a request: ~50 req/s at most, offered 400 req/s against a 30 ms limit
    engine = Recording(step_s=0.005)
    replays = trial(tmp_path, engine, warm=300, num_requests=300)
    started = time.monotonic()
    run(engine, {"max_num_seqs": 1}, lambda: replays.warm_up_under_load(400.0))
    # settled as a failure at the first look (25 requests resolved): the rest is never sent, nor waited for
    assert 25 <= len(engine.sent) < 150, len(engine.sent)
    assert time.monotonic() - started < 5.0
