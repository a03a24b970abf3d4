"""Fit the simulator's step-time model to a real engine, and measure how far the simulator is off.

Probes (one engine start, a minute on the CPU engine), each isolating terms of the model:
- prefill: one request alone with a prompt of L tokens; its TTFT is one prefill step of L tokens;
- decode: N requests with short prompts at once; once all have their first token and until the first finishes,
  every gap between tokens is one step with N decoding sequences and N x (prompt + generated) context tokens;
- long context: the same with long prompts, so that attention over the context shows.
Each probe is repeated; a non-negative least-squares fit on relative error gives the coefficients.

Validation runs the workload on configs the probes never used, on the real engine (each point twice, so that
the engine's own run-to-run spread is known: no model can be closer than that) and on the simulator, and reports
the relative error of output throughput and TTFT P99 per point (`validate`).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.core.clock import Clock
from optimizer.engines.sim.steptime import StepTimeModel
from optimizer.measurement.engine import Engine
from optimizer.measurement.metrics import RequestRecord, summarize
from optimizer.measurement.replay import replay
from optimizer.measurement.workload import Request, Workload

# The probes' engine: chunking on, prefix caching off (every probe computes its whole prompt), room for 128 sequences.
PROBE_PARAMS = {"max_num_seqs": 128, "max_num_batched_tokens": 2048, "enable_prefix_caching": False,
                "gpu_memory_utilization": 0.3}
# Held-out configs for validation: none equals the probe config; they differ in the knobs the study searches.
VALIDATION_PARAMS = (
    {"max_num_seqs": 4, "max_num_batched_tokens": 512, "gpu_memory_utilization": 0.3},
    {"max_num_seqs": 16, "max_num_batched_tokens": 1024, "long_prefill_token_threshold": 64,
     "gpu_memory_utilization": 0.3},
    {"max_num_seqs": 128, "max_num_batched_tokens": 4096, "enable_chunked_prefill": False,
     "gpu_memory_utilization": 0.3},
)


@dataclass(frozen=True)
class Observation:
    """One measured step: what it held and how long it took."""

    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    step_s: float
    probe: str
    prefill_attention: float = 0.0
    new_requests: int = 0

    @property
    def features(self) -> list[float]:
        """The step-time model's inputs, with 1 for its constant term."""
        return [1.0, self.prefill_tokens, self.decode_seqs, self.context_tokens, self.prefill_attention,
                self.new_requests]


def prefill_observations(records: list[RequestRecord], probe: str) -> list[Observation]:
    """Requests served alone: TTFT is one step that computes the whole prompt."""
    return [Observation(r.input_len, 0, 0, r.ttft_s, probe, r.input_len * r.input_len / 2, 1)
            for r in records if r.ok and r.ttft_s]


def decode_observations(records: list[RequestRecord], probe: str) -> list[Observation]:
    """Requests sent at once: the median gap while all of them decode, as one step of len(records) sequences."""
    ok = [r for r in records if r.ok and r.first_token_s is not None and r.finish_s is not None]
    if len(ok) != len(records) or not ok:
        return []
    window_start = max(r.first_token_s for r in ok)
    window_end = min(r.finish_s for r in ok)
    gaps, contexts = [], []
    for r in ok:
        for k, (a, b) in enumerate(zip(r.chunk_times_s, r.chunk_times_s[1:])):
            if a >= window_start and b <= window_end:
                gaps.append(b - a)
                contexts.append(r.input_len + k + 1)
    if not gaps:
        return []
    n = len(ok)
    return [Observation(0, n, int(n * float(np.median(contexts))), float(np.median(gaps)), probe)]


def fit(observations: list[Observation], start_s: float, shutdown_s: float) -> StepTimeModel:
    """Non-negative least squares on relative error: each observation weighs the same whatever its size."""
    x = np.array([o.features for o in observations])
    y = np.array([o.step_s for o in observations])
    w = 1.0 / y
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))  # the most negative term explains nothing: drop it and fit again
    return StepTimeModel(fixed_s=float(coef[0]), prefill_token_s=float(coef[1]), decode_seq_s=float(coef[2]),
                         context_token_s=float(coef[3]), prefill_attention_s=float(coef[4]),
                         request_s=float(coef[5]), engine_start_s=round(start_s, 2),
                         engine_shutdown_s=round(shutdown_s, 2))


def relative_error(simulated: float, measured: float) -> float:
    """(simulated - measured) / measured; NaN when the measurement is not a positive number."""
    if not (measured > 0 and math.isfinite(measured) and math.isfinite(simulated)):
        return math.nan
    return (simulated - measured) / measured


@dataclass
class ValidationPoint:
    """One held-out config at one rate: the real engine's replays (two, for its own run-to-run spread) and the
    simulator's."""

    params: dict[str, Any]
    rate_rps: float
    measured_tok_s: list[float]
    measured_ttft_p99_ms: list[float]
    simulated_tok_s: float
    simulated_ttft_p99_ms: float

    @property
    def throughput_error(self) -> float:
        return relative_error(self.simulated_tok_s, float(np.mean(self.measured_tok_s)))

    @property
    def ttft_p99_error(self) -> float:
        return relative_error(self.simulated_ttft_p99_ms, float(np.mean(self.measured_ttft_p99_ms)))

    @property
    def real_throughput_spread(self) -> float:
        """How far the real engine's two replays differ, relative to their mean: the floor of any model's error."""
        return _spread(self.measured_tok_s)

    @property
    def real_ttft_p99_spread(self) -> float:
        return _spread(self.measured_ttft_p99_ms)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rate_rps"] = None if math.isinf(self.rate_rps) else self.rate_rps
        for name in ("throughput_error", "ttft_p99_error", "real_throughput_spread", "real_ttft_p99_spread"):
            d[name] = getattr(self, name)
        return d


def _spread(values: list[float]) -> float:
    if len(values) < 2:
        return math.nan
    return relative_error(max(values), float(np.mean(values))) * 2 if np.mean(values) > 0 else math.nan


@dataclass
class Calibration:
    model: StepTimeModel
    observations: list[Observation] = field(default_factory=list)
    validation: list[ValidationPoint] = field(default_factory=list)

    def median_abs_error(self, which: str) -> float:
        values = [abs(getattr(p, which)) for p in self.validation if not math.isnan(getattr(p, which))]
        return float(np.median(values)) if values else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {"step_time_model": self.model.to_dict(),
                "observations": [asdict(o) for o in self.observations],
                "validation": [p.to_dict() for p in self.validation],
                "median_abs_error": {"output_throughput": self.median_abs_error("throughput_error"),
                                     "ttft_p99": self.median_abs_error("ttft_p99_error")},
                "real_engine_median_spread": {"output_throughput": self.median_abs_error("real_throughput_spread"),
                                              "ttft_p99": self.median_abs_error("real_ttft_p99_spread")}}


def _probe_request(index: int, input_len: int, output_len: int, rng: np.random.Generator) -> Request:
    return Request(index=index, prompt_token_ids=tuple(int(t) for t in rng.integers(100, 15000, size=input_len)),
                   output_len=output_len, unit_arrival_s=0.0)


async def probe(engine: Engine, clock: Clock, max_len: int, repeats: int = 3,
                say=lambda *a: None) -> list[Observation]:
    """Run the probes on a started engine (see the module docstring)."""
    rng = np.random.default_rng(0)
    out: list[Observation] = []
    idx = 0
    warm = [_probe_request(idx + i, 64, 8, rng) for i in range(4)]
    idx += len(warm)
    await replay(engine, warm, [0.0] * len(warm), clock)
    prompt_lens = [n for n in (16, 64, 256, 768, 1536) if n + 2 <= max_len]
    for _ in range(repeats):
        for n in prompt_lens:
            records = await replay(engine, [_probe_request(idx, n, 2, rng)], [0.0], clock)
            idx += 1
            out += prefill_observations(records, f"prefill {n}")
        for n_seqs, prompt in ((1, 16), (4, 16), (16, 16), (48, 16), (96, 16), (4, min(1024, max_len - 80))):
            batch = [_probe_request(idx + i, prompt, 64, rng) for i in range(n_seqs)]
            idx += n_seqs
            records = await replay(engine, batch, [0.0] * n_seqs, clock)
            out += decode_observations(records, f"decode {n_seqs}x{prompt}")
        say(f"  probes: {len(out)} observations")
    return out


async def validate(make_engine, params: dict[str, Any], workload: Workload, sim_engine, clock: Clock, load_fractions: tuple[float, ...] = (0.5, 0.8), real_runs: int = 2,
                   log_path: Path | None = None) -> list[ValidationPoint]:
    """The same replays on the real engine (fresh, cold, each rate `real_runs` times in rounds, for its own spread)
    and on the simulator with the fitted model: the burst, then Poisson rates at `load_fractions` of the real
    engine's burst ceiling."""
    real = make_engine()
    measured: dict[float, list[Any]] = {}
    try:
        await real.start(params, log_path)
        if workload.warmup:
            await replay(real, workload.warmup, [0.0] * len(workload.warmup), clock)
        rates = [math.inf]
        for _ in range(real_runs):  # in rounds, so that drift on a shared machine hits every rate alike
            for i in range(1 + len(load_fractions)):
                rate = rates[i]
                await real.reset_prefix_cache()
                m = summarize(await replay(real, workload.requests, workload.arrivals_s(rate), clock), rate)
                measured.setdefault(rate, []).append(m)
                if i == 0 and len(rates) == 1:  # the first burst gives the ceiling the rates are fractions of
                    rates += [round(f * m.request_throughput_rps, 2) for f in load_fractions]
    finally:
        await real.shutdown()
    points: list[ValidationPoint] = []
    await sim_engine.start(params)
    try:
        for rate, runs in measured.items():
            await sim_engine.reset_prefix_cache()
            sim = summarize(sim_engine.simulate_replay(workload.requests, workload.arrivals_s(rate)), rate)
            points.append(ValidationPoint(params, rate, [m.output_throughput_tok_s for m in runs],
                                          [m.ttft.p99_ms for m in runs], sim.output_throughput_tok_s,
                                          sim.ttft.p99_ms))
    finally:
        await sim_engine.shutdown()
    return points


async def calibrate(make_engine, make_sim, workload: Workload, max_len: int, clock: Clock,
                    validation_params=VALIDATION_PARAMS, repeats: int = 3, say=lambda *a: None,
                    log_path: Path | None = None) -> Calibration:
    """Probe and fit on one engine, then validate on held-out configs (see `validate`)."""
    engine = make_engine()
    t0 = time.perf_counter()
    try:
        await engine.start(PROBE_PARAMS, log_path)
        start_s = time.perf_counter() - t0
        say(f"probe engine started in {start_s:.1f} s")
        observations = await probe(engine, clock, max_len, repeats, say)
    finally:
        t1 = time.perf_counter()
        await engine.shutdown()
        shutdown_s = time.perf_counter() - t1
    result = Calibration(fit(observations, start_s, shutdown_s), observations)
    say(f"fitted: {result.model.to_dict()}")
    for params in validation_params:
        points = await validate(make_engine, params, workload, make_sim(result.model), clock,
                                log_path=log_path)
        result.validation += points
        for p in points:
            say(f"  {_short(params)} @ {_rate(p.rate_rps)}: throughput real {_nums(p.measured_tok_s)} vs sim "
                f"{p.simulated_tok_s:.0f} ({p.throughput_error:+.0%}); TTFT P99 real {_nums(p.measured_ttft_p99_ms)} "
                f"vs sim {p.simulated_ttft_p99_ms:.0f} ms ({p.ttft_p99_error:+.0%})")
    return result


def _short(params: dict[str, Any]) -> str:
    names = {"max_num_seqs": "seqs", "max_num_batched_tokens": "mnbt", "long_prefill_token_threshold": "lpt",
             "enable_chunked_prefill": "chunked"}
    return " ".join(f"{names[k]}={v}" for k, v in params.items() if k in names)


def _nums(values: list[float]) -> str:
    return "/".join(f"{v:.0f}" for v in values)


def _rate(rate_rps: float) -> str:
    return "burst" if math.isinf(rate_rps) else f"{rate_rps:g} req/s"
