"""A live replay with a stop rule, on the fake engine in real time: it stops sending, withdraws what still waits
for a first token, and returns without an error."""

import asyncio

from optimizer.core.clock import MonotonicClock
from tests.support.fake_engine import FakeEngine
from optimizer.measurement.replay import WITHDRAWN, replay
from optimizer.measurement.workload import Request


def test_a_stopped_replay_withdraws_the_waiting_and_returns():
    requests = [Request(index=i, prompt_token_ids=(101,) * 16, output_len=4, unit_arrival_s=0.01 * i)
                for i in range(40)]
    arrivals = [r.unit_arrival_s for r in requests]
    engine = FakeEngine(step_s=0.05)  # one sequence at a time, 50 ms a step: requests queue

    async def main():
        await engine.start({"max_num_seqs": 1})
        try:
            # stop after 10 sends: the slowest of those may still be waiting for their first token
            return await replay(engine, requests, arrivals, MonotonicClock(), stop=lambda recs, now: len(recs) >= 10)
        finally:
            await engine.shutdown()

    records = asyncio.run(main())
    assert len(records) == 10  # nothing sent after the stop
    assert all(r.ok or r.error == WITHDRAWN for r in records)
    assert any(r.error == WITHDRAWN for r in records) and any(r.ok for r in records)
