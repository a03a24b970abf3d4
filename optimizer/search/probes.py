"""One trial's replays on its engine: the warm-up, probes sized by evidence, and the rate search from where the
study stands (the incumbent's rate, the candidate's bracket or its earlier rounds' rate for a confirmation run, or a
first guess)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from optimizer.config.settings import StudyConfig
from optimizer.core.clock import Clock
from optimizer.measurement.engine import Engine, ReportsEngineStats
from optimizer.measurement.evidence import FAIL
from optimizer.measurement.probe_rule import ProbeRule
from optimizer.measurement.limits import summarize_engine
from optimizer.measurement.metrics import RequestRecord, ReplayMetrics, summarize
from optimizer.measurement.rate_search import (INCUMBENT_FLOOR, RUN_FIT_BRACKET, CurvePoint, RateSearchResult,
                                                search_rate)
from optimizer.measurement.replay import WITHDRAWN, replay, replay_closed_loop
from optimizer.measurement.workload import Workload, fixed_load_rate
from optimizer.search.confirm import start_rates
from optimizer.search.records import RecordStore
from optimizer.search.repeats import confirm_best, measure_fixed_load

GUESS_REQUESTS = 64  # a first trial's first guess: the pace of this many requests sent at once (not in its curve)
GUESS_SHARE = 0.8  # of that pace, where its first probe goes


@dataclass
class TrialReplays:
    """The replays of one trial: each cold, its records stored, the engine's view of it kept in `engine_points`."""

    engine: Engine
    workload: Workload
    config: StudyConfig
    clock: Clock
    records: RecordStore | None
    trial_number: int
    engine_points: list[dict[str, Any] | None]
    replays: int = 0
    study_name: str | None = None  # whose trial it is, for its records (None: the config's study)

    async def run_replay(self, rate_rps: float, rule: ProbeRule | None = None) -> list[RequestRecord]:
        """One cold replay at `rate_rps` (a probe when `rule` is given: it stops when the rule's verdict is settled)."""
        engine, spec, workload = self.engine, self.config.workload, self.workload
        stats = engine if isinstance(engine, ReportsEngineStats) else None
        # Cold every time: a replay must never be served from the previous replay's prefix cache.
        await engine.reset_prefix_cache()
        if stats is not None:
            await stats.take_engine_stats()  # drop what came before (warm-up, the previous replay's tail)
        if spec.arrivals == "closed_loop":  # fixed clients, no rate: see measure_fixed_load
            records = await replay_closed_loop(engine, workload.requests, spec.concurrency or 1, self.clock)
        else:
            records = await replay(engine, workload.requests, workload.arrivals_s(rate_rps), self.clock, rule)
            if rule is not None:  # withdrawn before their first token: judged only when already past the limit
                records = rule.kept(records, WITHDRAWN)
        self.engine_points.append(summarize_engine(await stats.take_engine_stats()) if stats is not None else None)
        if self.records is not None:  # between replays, never inside one
            self.records.save(self.study_name or self.config.study_name, self.trial_number, self.replays, rate_rps,
                              records)
        self.replays += 1
        return records

    async def replay_at(self, rate_rps: float) -> ReplayMetrics:
        """A replay of the workload's full length."""
        spec = self.config.workload
        return summarize(await self.run_replay(rate_rps), rate_rps, spec.skip_first_fraction, spec.skip_last_fraction)

    async def probe_at(self, rate_rps: float) -> CurvePoint:
        """A probe sized by evidence (measurement/evidence.py), as one curve point with its counts."""
        spec, limits = self.config.workload, self.config.limits
        rule = ProbeRule(limits, len(self.workload.requests), 1 - self.config.search.probe_confidence)
        records = await self.run_replay(rate_rps, rule)
        evidence = rule.evidence(sorted(records, key=lambda r: (r.sent_s, r.index)))
        return CurvePoint.of_probe(summarize(records, rate_rps, spec.skip_first_fraction, spec.skip_last_fraction),
                                   evidence, limits)

    async def first_guess(self) -> float:
        """Where a search with nothing to start from probes first: GUESS_SHARE x the pace of GUESS_REQUESTS sent at
        once. A guess only: the search brackets up from it when it passes, and its TTFTs are in no curve."""
        await self.engine.reset_prefix_cache()
        first = self.workload.requests[:GUESS_REQUESTS]
        records = await replay(self.engine, first, [0.0] * len(first), self.clock)
        return max(GUESS_SHARE * summarize(records, math.inf).request_throughput_rps, self.config.search.min_rate_rps)

    async def warm_up_under_load(self, rate_rps: float) -> None:
        """The first `warmup_load_requests` measured requests at `rate_rps`, measured nowhere: an engine's first
        replays after its start serve slower than its later ones (docs/measurement.md, "Warm-up under load"), and
        a trial's first probe would otherwise pay for it. Nothing is stored, and the probes after it start cold."""
        count = min(self.config.workload.warmup_load_requests, len(self.workload.requests))
        if count == 0 or not math.isfinite(rate_rps) or rate_rps <= 0:
            return
        # past the engine's capacity it stops as a probe would fail there: a queue hundreds of requests long
        # would only take its time to drain
        rule = ProbeRule(self.config.limits, count, 1 - self.config.search.probe_confidence)
        await self.engine.reset_prefix_cache()
        await replay(self.engine, self.workload.requests[:count], self.workload.arrivals_s(rate_rps)[:count],
                     self.clock, lambda records, now_s: rule(records, now_s) and rule.settled.verdict == FAIL)

    async def measure(self, incumbent_rate_rps: float | None, repeats: int = 1,
                      confirm: dict[str, Any] | None = None) -> RateSearchResult:
        """The warm-up, then the trial's measurement: at a load the workload fixes, replays there; for a confirmation
        run, the rate at the limit from where its plan put it (`start_rates`); otherwise from the incumbent's rate
        (stopping below its floor) or a first guess."""
        workload, search, limits = self.workload, self.config.search, self.config.limits
        if workload.warmup:
            await replay(self.engine, workload.warmup, [0.0] * len(workload.warmup), self.clock)
        fixed_rate = fixed_load_rate(self.config.workload, workload)
        if fixed_rate is not None:
            await self.warm_up_under_load(fixed_rate)
            return await measure_fixed_load(self.replay_at, fixed_rate, limits, search, repeats)
        if confirm is not None:
            start_rps, failed_rps, step = start_rates(confirm)
            guess = None
            if not math.isfinite(start_rps):
                guess = start_rps = await self.first_guess()
            await self.warm_up_under_load(start_rps)
            result = await search_rate(self.probe_at, search, start_rps, failed_rps=failed_rps, step=step,
                                       fit_bracket=RUN_FIT_BRACKET)
            result.first_guess_rps = guess
            return result
        if incumbent_rate_rps is not None and math.isfinite(incumbent_rate_rps):
            # the one question that matters first: does it hold where the incumbent does? Below the floor it
            # cannot win.
            await self.warm_up_under_load(incumbent_rate_rps)
            result = await search_rate(self.probe_at, search, incumbent_rate_rps,
                                       floor_rps=max(INCUMBENT_FLOOR * incumbent_rate_rps, search.min_rate_rps))
        else:
            guess = await self.first_guess()
            await self.warm_up_under_load(guess)
            result = await search_rate(self.probe_at, search, guess)
            result.first_guess_rps = guess
        if result.best is not None and repeats > 1:
            await confirm_best(result, self.replay_at, repeats, limits)
        return result
