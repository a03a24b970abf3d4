"""The measuring process's own garbage collections kept out of a replay (measurement/quiet_heap.py): the objects
from before a replay are out of the collector's reach while it runs, and back after it."""

import asyncio
import gc

from optimizer.core.clock import MonotonicClock
from tests.support.fake_engine import FakeEngine
from optimizer.measurement.quiet_heap import GcPauses, frozen_heap
from optimizer.measurement.replay import replay
from optimizer.measurement.workload import Request


def test_a_collection_inside_walks_only_what_was_allocated_since():
    held = [[i] for i in range(50_000)]  # tracked objects alive from before, like vLLM's and torch's
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() >= len(held)
        new = [[i] for i in range(100)]
        reachable = len(gc.get_objects())  # every generation the collector walks
        assert len(new) <= reachable < len(held)
        with GcPauses() as pauses:
            gc.collect(2)
        assert [g for g, _ in pauses.pauses] == [2] and pauses.max_ms >= 0
    assert gc.get_freeze_count() == 0 and len(gc.get_objects()) > len(held)  # handed back, collectable again


def test_a_live_replay_runs_with_the_heap_from_before_it_frozen():
    requests = [Request(index=i, prompt_token_ids=(101,) * 8, output_len=2, unit_arrival_s=0.005 * i)
                for i in range(10)]
    seen = []

    class Watched(FakeEngine):
        def generate(self, request):
            seen.append(gc.get_freeze_count())
            return super().generate(request)

    engine = Watched()

    async def main():
        await engine.start({"max_num_seqs": 4})
        try:
            return await replay(engine, requests, [r.unit_arrival_s for r in requests], MonotonicClock())
        finally:
            await engine.shutdown()

    before = len(gc.get_objects())
    records = asyncio.run(main())
    assert all(r.ok for r in records) and len(seen) == len(requests)
    assert min(seen) >= before // 2  # what the process held before the replay was out of the collector's reach
    assert gc.get_freeze_count() == 0  # and is back after it
