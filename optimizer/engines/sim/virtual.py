"""Replay a workload through the scheduler in virtual time: seconds of traffic in milliseconds of compute.

A discrete-event loop: requests arrive at their planned times; whenever the engine is idle the clock jumps to
the next arrival; otherwise one step is planned, its duration taken from the step-time model, and every token
it produced is stamped with the step's end. The records are the same `RequestRecord`s a real replay makes, so
the same metric code (optimizer/measurement/metrics.py) summarizes both.
"""

from __future__ import annotations

from dataclasses import dataclass

from optimizer.engines.sim.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from optimizer.engines.sim.steptime import StepTimeModel
from optimizer.measurement.metrics import RequestRecord
from optimizer.measurement.workload import Request


@dataclass
class SimulatedReplay:
    records: list[RequestRecord]
    stats: SchedulerStats
    duration_s: float  # virtual seconds from the first send to the last token


def simulate(requests: list[Request] | tuple[Request, ...], arrivals_s: list[float], config: SchedulerConfig,
             model: StepTimeModel, scheduler: Scheduler | None = None) -> SimulatedReplay:
    """Serve `requests[i]` arriving at `arrivals_s[i]`; pass `scheduler` to keep its prefix cache across calls."""
    sched = scheduler or Scheduler(config)
    order = sorted(range(len(requests)), key=lambda i: arrivals_s[i])
    records = [RequestRecord(index=r.index, input_len=r.input_len, planned_s=arrivals_s[i], sent_s=arrivals_s[i])
               for i, r in enumerate(requests)]
    now = 0.0
    nxt = 0
    while nxt < len(order) or not sched.idle:
        while nxt < len(order) and arrivals_s[order[nxt]] <= now:
            i = order[nxt]
            sched.add(requests[i], key=records[i])
            nxt += 1
        if sched.idle:
            now = arrivals_s[order[nxt]]
            continue
        plan = sched.plan()
        if not plan.scheduled:
            if not plan.preempted:  # nothing fits even alone (larger than the whole KV cache): it never runs
                _fail_unservable(sched)
            continue
        now += model.step_s(*plan.time_inputs)
        emitted, _ = sched.finish(plan)
        for seq in emitted:
            rec: RequestRecord = seq.key
            if rec.first_token_s is None:
                rec.first_token_s = now
            rec.chunk_times_s.append(now)
            rec.output_tokens += 1
    for rec in records:
        rec.ok = rec.output_tokens > 0
        if not rec.ok and not rec.error:
            rec.error = "no output"
    start = min(arrivals_s, default=0.0)
    return SimulatedReplay(records, sched.stats, max(now - start, 0.0))


def _fail_unservable(sched: Scheduler) -> None:
    seq = sched.waiting.popleft() if sched.waiting else sched.running.pop()
    rec: RequestRecord = seq.key
    rec.error = "the request does not fit in the KV cache"
