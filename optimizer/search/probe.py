"""How fast this machine serves the embedded demo, measured in under a minute before a demo study is created.

The demo must work on any CPU: a core with native bf16 serves the 17M-parameter demo model's longest prompt in
~15 ms, an AVX2-only core in float32 several times slower, so that a 150 ms limit could not be met by any
config there. The probe starts vLLM's defaults on the largest embedded shape and measures

- lone prefill: the demo's longest prompt, alone in the engine, three times (median TTFT);
- decode: time per output token of a lone request, which is mostly the engine's per-step overhead;
- the burst ceiling: the demo's requests all sent at once, completed requests per second;
- engine start and shutdown (a study's second start: the first, untimed, pays its one-off imports).

From these it chooses the largest shape whose predicted lone prefill stays within a share of the limit (prefill
time past the per-step overhead scales with the shape's compute per token) and whose study is estimated to end
in time (40 trials in 36 minutes; a smaller model replays faster; when even the smallest is late, each replay
sends fewer requests), and prints that estimate. The result is stored
with the study; a resume never probes again.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.config.model import DEMO_LADDER, DemoShape, demo_shape
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.core.clock import Clock
from optimizer.measurement.engine import Engine
from optimizer.measurement.engine_watch import WatchedEngine
from optimizer.measurement.metrics import RequestRecord
from optimizer.measurement.replay import replay
from optimizer.measurement.workload import Request, build_workload

LONE_PROMPTS = 3
LONE_OUTPUT_TOKENS = 16
BURST_REQUESTS = 60
# A lone prefill of the longest prompt within this share of the limit leaves the rest of the limit to queueing
# and batching, where configs differ. Measured: the 17M shape's lone prefill on a native-bf16 Xeon core is ~8%
# of 150 ms, and that demo's defaults meet 150 ms at ~11 req/s while its worst configs do not at any rate.
PREFILL_SHARE_OF_LIMIT = 0.2
# Duration model of a demo trial, in units of one probe at the cap (the workload's request count) at the knee's
# rate. A trial's probes stop when their verdict is settled: those far from the limit after a few dozen requests,
# those near it at the cap; most trials probe at the incumbent's rate and its floor. The knee of a Poisson stream
# lies near the pace of a burst (in process the demo's defaults hold 150 ms at 1.3-1.7x it), so the knee's rate is
# taken as the burst's. On the demo with warm engine starts (docs/machines.md#timing), in those units, a search
# trial's replays take 0.54-0.83 probes at the cap, counted as 1 so that the estimate stays above the run. A
# confirmation run starts at its config's rate so far (search/confirm.py::prior_spec): its replays and warm-up take
# ~41 s, a warm-up of ~6 s and ~1.76 probes of ~20 s; its one more bisection near the limit
# (measurement/rate_search.py::RUN_FIT_BRACKET, ~800-1000 requests) adds ~0.6: 2.4, counted as 2.5. The baseline,
# which brackets from a first guess, takes about 3 more.
REPLAYS_PER_TRIAL = 1.0
KNEE_FRACTION_OF_CEILING = 1.0
BASELINE_EXTRA_REPLAYS = 3
CONFIRM_REPLAYS = 2.5
# The demo promises 40 trials in 40 minutes on any CPU: aim at 54 s per trial, a tenth below, for noise.
TARGET_S_PER_TRIAL = 54.0
# When even the quickest shape is estimated past that, each probe sends at most fewer requests (an engine start
# and shutdown, ~30 s a trial, cannot shrink), down to this many: with none over, 459 settle a pass at 95%.
MIN_DEMO_REQUESTS = 500


@dataclass(frozen=True)
class ProbeResult:
    """What the probe measured, on which shape and dtype."""

    model: str
    dtype: str
    start_s: float
    shutdown_s: float
    prefill_ms: float  # median lone TTFT of the longest demo prompt
    decode_ms: float  # median time per output token of a lone request
    burst_rps: float  # completed requests per second when the demo's requests arrive at once
    prompt_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProbeResult:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class DemoScale:
    """The shape chosen for this machine and limit, its predicted lone prefill, and the study's estimated length."""

    model: str
    predicted_prefill_ms: float
    limit_ms: float
    estimated_s: float
    fits: bool  # False: even the smallest shape's prefill is past the share of the limit
    num_requests: int = 0  # requests per replay; fewer than asked when even the quickest shape is late (0: as asked)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def predicted_prefill_ms(result: ProbeResult, shape: DemoShape) -> float:
    """Pure: lone prefill of `shape` from the probed one: per-step overhead (a decode step) plus compute scaled by
    compute per token."""
    probed = demo_shape(result.model)
    compute_ms = max(result.prefill_ms - result.decode_ms, 0.0)
    return result.decode_ms + compute_ms * shape.flops_per_token / probed.flops_per_token


def estimate_study_s(result: ProbeResult, budget: int, num_requests: int, speedup: float = 1.0,
                     confirm_runs: int = 0, warmup_load_requests: int = 0) -> float:
    """Pure: how long `budget` demo trials take, `confirm_runs` of them confirmation runs (search/confirm.py: a
    fresh engine and CONFIRM_REPLAYS replays each), each after a warm-up of `warmup_load_requests` at the knee's
    rate. `speedup`: how much faster the chosen shape serves than the probed one (>= 1: a smaller model at the same
    per-step overhead)."""
    ceiling = max(result.burst_rps * speedup, 1e-6)
    knee_rps = KNEE_FRACTION_OF_CEILING * ceiling
    replay_s = num_requests / knee_rps
    fixed_s = result.start_s + result.shutdown_s + warmup_load_requests / knee_rps
    trial_s = fixed_s + REPLAYS_PER_TRIAL * replay_s
    run_s = fixed_s + CONFIRM_REPLAYS * replay_s
    return (budget - confirm_runs) * trial_s + BASELINE_EXTRA_REPLAYS * replay_s + confirm_runs * run_s


def estimate_shape_s(result: ProbeResult, shape: DemoShape, budget: int, num_requests: int,
                     confirm_runs: int = 0, warmup_load_requests: int = 0) -> float:
    """Pure: `estimate_study_s` for `shape`: a smaller model serves faster than the probed one, though not by its
    compute ratio (the per-step overhead stays): half of its prefill speedup is counted."""
    predicted = predicted_prefill_ms(result, shape)
    speedup = max(result.prefill_ms / predicted, 1.0) if predicted > 0 else 1.0
    return estimate_study_s(result, budget, num_requests, speedup=1 + (speedup - 1) / 2, confirm_runs=confirm_runs,
                            warmup_load_requests=warmup_load_requests)


def choose_scale(result: ProbeResult, limit_ms: float, budget: int, num_requests: int,
                 ladder: tuple[DemoShape, ...] = DEMO_LADDER, confirm_runs: int = 0,
                 warmup_load_requests: int = 0) -> DemoScale:
    """Pure: the largest shape whose predicted lone prefill is within PREFILL_SHARE_OF_LIMIT of the limit and whose
    study is estimated within TARGET_S_PER_TRIAL x `budget`; when none is, the smallest whose prefill fits (the
    quickest); when no prefill fits, the smallest."""
    allowed = PREFILL_SHARE_OF_LIMIT * limit_ms
    fitting = [s for s in ladder if predicted_prefill_ms(result, s) <= allowed]
    quick = [s for s in fitting
             if estimate_shape_s(result, s, budget, num_requests, confirm_runs, warmup_load_requests)
             <= TARGET_S_PER_TRIAL * budget]
    shape = quick[0] if quick else (fitting or ladder)[-1]  # none in time: the quickest
    count = num_requests if quick else requests_in_time(result, shape, budget, num_requests, confirm_runs,
                                                        warmup_load_requests)
    return DemoScale(model=shape.name, predicted_prefill_ms=predicted_prefill_ms(result, shape), limit_ms=limit_ms,
                     estimated_s=estimate_shape_s(result, shape, budget, count, confirm_runs, warmup_load_requests),
                     fits=bool(fitting),
                     num_requests=count)


def requests_in_time(result: ProbeResult, shape: DemoShape, budget: int, num_requests: int,
                     confirm_runs: int = 0, warmup_load_requests: int = 0) -> int:
    """Pure: the most requests per replay (a multiple of 10, at most `num_requests`, at least MIN_DEMO_REQUESTS)
    with which `budget` trials of `shape` are estimated within TARGET_S_PER_TRIAL each. The estimate is linear in
    the count: fixed engine starts and shutdowns, plus replays that last in proportion to their requests."""
    fixed_s = estimate_shape_s(result, shape, budget, 0, confirm_runs, warmup_load_requests)
    total_s = estimate_shape_s(result, shape, budget, num_requests, confirm_runs, warmup_load_requests)
    per_request_s = (total_s - fixed_s) / max(num_requests, 1)
    if per_request_s <= 0:
        return num_requests
    fit = int((TARGET_S_PER_TRIAL * budget - fixed_s) / per_request_s) // 10 * 10
    return max(min(fit, num_requests), min(MIN_DEMO_REQUESTS, num_requests))


def _lone_request(rng: np.random.Generator, index: int, prompt_tokens: int, output_tokens: int,
                  vocab_size: int) -> Request:
    ids = tuple(int(x) for x in rng.integers(100, vocab_size, size=prompt_tokens))
    return Request(index=index, prompt_token_ids=ids, output_len=output_tokens, unit_arrival_s=0.0)


def _tpot_ms(rec: RequestRecord) -> float | None:
    if rec.output_tokens < 2 or rec.first_token_s is None or rec.finish_s is None:
        return None
    return 1000 * (rec.finish_s - rec.first_token_s) / (rec.output_tokens - 1)


async def probe(engine_factory: Callable[[], Engine], spec: WorkloadSpec, vocab_size: int, clock: Clock,
                model: str, dtype: str, params: dict[str, Any], log_path: Path | None = None) -> ProbeResult:
    """Start the engine with `params` (vLLM's defaults, as the baseline runs them), untimed, shut it down, start it
    again and measure that start, lone prefill, decode and the burst ceiling (see the module doc)."""
    from optimizer.core.errors import OptimizerError

    workload = build_workload(spec.model_copy(update={"num_requests": BURST_REQUESTS}), vocab_size)
    rng = np.random.default_rng(12345)
    # A first start pays what only a study's first start pays (vLLM's import here, the warm starts' fork server,
    # optimizer/engines/warm_start.py): it is not timed, so that the start the estimate counts is a trial's.
    priming = WatchedEngine(engine_factory())
    try:
        await priming.start(params, log_path)
    finally:
        await priming.shutdown()
    engine = WatchedEngine(engine_factory())  # a death or a hang ends the probe with EngineDiedError
    t0 = clock.now()
    try:
        await engine.start(params, log_path)
        start_s = clock.now() - t0
        for req in workload.warmup:
            await replay(engine, [req], [0.0], clock)
        prefill, decode = [], []
        for i in range(LONE_PROMPTS):
            req = _lone_request(rng, 10_000 + i, spec.input_len_max, LONE_OUTPUT_TOKENS, vocab_size)
            await engine.reset_prefix_cache()
            (rec,) = await replay(engine, [req], [0.0], clock)
            if not rec.ok or rec.ttft_s is None:
                raise OptimizerError(f"the probe's lone request failed ({rec.error or 'no output'}): see "
                                     f"{log_path or 'the engine output'}")
            prefill.append(1000 * rec.ttft_s)
            tpot = _tpot_ms(rec)
            if tpot is not None:
                decode.append(tpot)
        await engine.reset_prefix_cache()
        records = await replay(engine, workload.requests, workload.arrivals_s(math.inf), clock)
        done = [r for r in records if r.ok and r.finish_s is not None]
        span_s = max((r.finish_s for r in done), default=0.0) - min((r.sent_s for r in records), default=0.0)
        burst_rps = len(done) / span_s if span_s > 0 else 0.0
    finally:
        t1 = clock.now()
        await engine.shutdown()
        shutdown_s = clock.now() - t1
    return ProbeResult(model=model, dtype=dtype, start_s=round(start_s, 2), shutdown_s=round(shutdown_s, 2),
                       prefill_ms=round(statistics.median(prefill), 2),
                       decode_ms=round(statistics.median(decode) if decode else 0.0, 3),
                       burst_rps=round(burst_rps, 3), prompt_tokens=spec.input_len_max)
