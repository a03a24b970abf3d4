"""Replay a workload against an Engine at one offered rate and record what happened to every request."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from optimizer.core.clock import Clock
from optimizer.core.errors import EngineDiedError
from optimizer.measurement.engine import Engine, ServesInVirtualTime
from optimizer.measurement.metrics import RequestRecord
from optimizer.measurement.quiet_heap import frozen_heap
from optimizer.measurement.workload import Request


async def _serve(engine: Engine, request: Request, record: RequestRecord, clock: Clock) -> None:
    try:
        async for n_tokens in engine.generate(request):
            t = clock.now()
            if record.first_token_s is None:
                record.first_token_s = t
            record.chunk_times_s.append(t)
            record.output_tokens += n_tokens
        record.ok = record.first_token_s is not None
        if not record.ok:
            record.error = "no output"
    except EngineDiedError:
        raise
    except Exception as exc:  # a failed request is data, not a crash of the replay
        record.ok = False
        record.error = f"{type(exc).__name__}: {exc}"


# Stop sending when this says so: called with the records sent so far (send order) and the replay's clock.
StopRule = Callable[[Sequence[RequestRecord], float], bool]
# The error of a request still waiting for its first token when its replay stopped: it was withdrawn, not served.
WITHDRAWN = "withdrawn: the replay stopped before its first token"


def withdraw(record: RequestRecord) -> None:
    """Mark a request withdrawn before its first token (its task is cancelled, or in virtual time never was served)."""
    record.first_token_s = None
    record.chunk_times_s = []
    record.output_tokens = 0
    record.ok = False
    record.error = WITHDRAWN


async def replay(engine: Engine, requests: list[Request] | tuple[Request, ...], arrivals_s: list[float],
                 clock: Clock, stop: StopRule | None = None) -> list[RequestRecord]:
    """Send `requests[i]` at `arrivals_s[i]` after the start and wait for all of them.

    With `stop`, before each send: when `stop(records, now)` is true, nothing more is sent, the requests that have
    their first token finish, and those still waiting for it are withdrawn (cancelled, marked WITHDRAWN): a probe
    whose verdict is settled (optimizer/measurement/evidence.py) does not wait for a queue to drain. Times in the
    records are relative to the replay's start. An engine death aborts the replay (EngineDiedError); any other
    request error is recorded on that request. An engine that runs in virtual time (`simulate_replay`, the
    simulator) serves the whole replay at once instead, with the same records, cut where `stop` would have stopped
    sending.
    """
    if isinstance(engine, ServesInVirtualTime):
        return stopped_in_virtual_time(engine.simulate_replay(requests, arrivals_s), stop)
    with frozen_heap():  # this process's collections walk only what the replay allocates (quiet_heap.py)
        return await _replay_live(engine, requests, arrivals_s, clock, stop)


async def _replay_live(engine: Engine, requests: list[Request] | tuple[Request, ...], arrivals_s: list[float],
                       clock: Clock, stop: StopRule | None) -> list[RequestRecord]:
    start = clock.now()
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task[None]] = []
    sent_tasks = tasks  # every task started, the withdrawn ones included: all are settled on the way out
    order = sorted(range(len(requests)), key=lambda i: arrivals_s[i])
    try:
        for i in order:
            planned = start + arrivals_s[i]
            await clock.sleep_until(planned)
            if stop is not None and stop(records, clock.now() - start):
                for rec, task in zip(records, tasks):
                    if rec.first_token_s is None:
                        task.cancel()
                        withdraw(rec)
                tasks = [t for t, rec in zip(tasks, records) if rec.error != WITHDRAWN]  # the rest end in _settle
                break
            req = requests[i]
            rec = RequestRecord(index=req.index, input_len=req.input_len, planned_s=arrivals_s[i],
                                sent_s=clock.now() - start)
            records.append(rec)
            tasks.append(asyncio.create_task(_serve(engine, req, rec, _Shifted(clock, start))))
        await asyncio.gather(*tasks)
    finally:
        await _settle(sent_tasks)
    return records


def stopped_in_virtual_time(records: list[RequestRecord], stop: StopRule | None) -> list[RequestRecord]:
    """A replay served whole in virtual time, cut as a live replay with `stop` would have been: the rule is asked
    before each send, with the records sent until then and the send's time (it reads only first tokens up to that
    time). The requests already sent keep their records; their decode shared the engine with later arrivals that a
    live replay would not have sent, a small difference the simulator accepts."""
    if stop is None:
        return records
    in_order = sorted(records, key=lambda r: (r.sent_s, r.index))
    for i, rec in enumerate(in_order):
        if i and stop(in_order[:i], rec.sent_s):
            for sent in in_order[:i]:
                if sent.first_token_s is None or sent.first_token_s > rec.sent_s:
                    withdraw(sent)
            return in_order[:i]
    return in_order


async def _settle(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel what is still running (an engine death, Ctrl-C) and wait until every task has ended."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class _Shifted:
    """A clock that reads zero at the replay's start."""

    def __init__(self, clock: Clock, origin: float) -> None:
        self._clock, self._origin = clock, origin

    def now(self) -> float:
        return self._clock.now() - self._origin

    async def sleep_until(self, t: float) -> None:
        await self._clock.sleep_until(t + self._origin)


async def replay_closed_loop(engine: Engine, requests: list[Request] | tuple[Request, ...], concurrency: int,
                             clock: Clock) -> list[RequestRecord]:
    """`concurrency` clients take the requests in order; each sends its next one when its previous one finishes.

    The load is fixed by the clients, not by a rate: `planned_s` is the send time. Times are relative to the
    start, as in `replay`; an engine death aborts the replay, any other request error is recorded on its request.
    """
    start = clock.now()
    shifted = _Shifted(clock, start)
    pending = iter(requests)  # shared by the clients; taking the next request never awaits, so no lock is needed
    records: list[RequestRecord] = []

    async def client() -> None:
        for req in pending:
            sent = shifted.now()
            rec = RequestRecord(index=req.index, input_len=req.input_len, planned_s=sent, sent_s=sent)
            records.append(rec)
            await _serve(engine, req, rec, shifted)

    with frozen_heap():
        tasks = [asyncio.create_task(client()) for _ in range(min(concurrency, len(requests)))]
        try:
            await asyncio.gather(*tasks)
        finally:
            await _settle(tasks)
    return records
