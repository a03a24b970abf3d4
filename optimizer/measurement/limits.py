"""Pure: what limited a replay, from the engine's own view of it (scheduler counts and per-request timings).

A request's TTFT as the client sees it is roughly: time in the engine's queue (queued -> first scheduled) +
prefill (first scheduled -> first token) + what happens outside the scheduler (front end, transfers). Which of
these dominates, together with the scheduler's peaks, names the knob that held the config back:

- `kv_cache`: requests were preempted, or the KV cache was (nearly) full: raise `gpu_memory_utilization` or
  lower `max_model_len`;
- `max_num_seqs`: requests queued while running sat at `max_num_seqs`;
- `token_budget`: requests queued while running stayed below `max_num_seqs`: the step's token budget
  (`max_num_batched_tokens`) admitted no more;
- `prefill`: prefill took longer than queueing: the prompt compute itself;
- `outside_engine`: queueing and prefill together explain less than half of TTFT P99.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from optimizer.measurement.engine import EngineStats
from optimizer.measurement.metrics import Distribution

KV_FULL = 0.95  # KV usage at or above this counts as full
ENGINE_SHARE = 0.5  # queueing + prefill must explain at least this share of TTFT P99 to blame the engine


def _ms(value: float) -> float | None:
    return round(value, 3) if math.isfinite(value) else None


def summarize_engine(stats: EngineStats) -> dict[str, Any]:
    """One replay's engine stats as a JSON-safe dict (stored in the replay's curve point under "engine")."""
    timings = list(stats.requests.values())
    queued = Distribution.of_seconds([t.queued_s for t in timings])
    prefill = Distribution.of_seconds([t.prefill_s for t in timings])
    return {
        "steps": stats.steps,
        "running_peak": stats.running_peak,
        "running_mean": round(stats.running_mean, 3),
        "waiting_peak": stats.waiting_peak,
        "max_num_seqs": stats.max_num_seqs,
        "kv_usage_peak": round(stats.kv_usage_peak, 4),
        "preemptions": stats.preemptions,
        "requests": len(timings),
        "queued_p50_ms": _ms(queued.p50_ms),
        "queued_p99_ms": _ms(queued.p99_ms),
        "prefill_p50_ms": _ms(prefill.p50_ms),
        "prefill_p99_ms": _ms(prefill.p99_ms),
    }


@dataclass(frozen=True)
class Diagnosis:
    label: str  # kv_cache, max_num_seqs, token_budget, prefill, outside_engine
    line: str  # the one line a person reads


def diagnose(engine: dict[str, Any] | None, ttft_p99_ms: float | None, bound_text: str | None = None,
             bound_metric: str | None = None) -> Diagnosis | None:
    """What limited a replay, from its `summarize_engine` dict and the client's TTFT P99; None without data. With
    the limit that bound the trial (`bound_text`, 'TPOT P99 61 ms > 50 ms at 48.2 req/s', and its metric), the line
    leads with it; a TPOT or ITL limit is a decode limit: `decode_batch` unless the KV cache was full."""
    if not engine or not engine.get("requests"):
        return None
    queued = engine.get("queued_p99_ms") or 0.0
    prefill = engine.get("prefill_p99_ms") or 0.0
    peak, cap = engine.get("running_peak", 0), engine.get("max_num_seqs")
    kv, preemptions = engine.get("kv_usage_peak", 0.0), engine.get("preemptions", 0)
    ttft = ttft_p99_ms if ttft_p99_ms is not None and math.isfinite(ttft_p99_ms) else None
    if preemptions or kv >= KV_FULL:
        label, why = "kv_cache", f"KV cache peaked at {kv:.0%} with {preemptions} preemptions"
    elif bound_metric in ("tpot", "itl"):
        label, why = "decode_batch", (f"{peak} sequences decoded together at the peak (max_num_seqs {cap or '?'}): "
                                      "each step serves them all, so each streams slower")
    elif ttft is not None and queued + prefill < ENGINE_SHARE * ttft:
        label, why = "outside_engine", "most of TTFT is spent outside the engine's scheduler"
    elif queued > prefill and cap and peak >= cap:
        label, why = "max_num_seqs", f"running peaked at {peak}/{cap}"
    elif queued > prefill:
        label, why = "token_budget", (f"requests queued while running peaked at {peak}/{cap or '?'} "
                                      "(max_num_batched_tokens admits no more per step)")
    else:
        label, why = "prefill", f"prefill outweighs queueing; running peaked at {peak}/{cap or '?'}"
    ttft_text = f"TTFT P99 {ttft:.0f} ms" if ttft is not None else "TTFT P99 n/a"
    lead = f"limited by {bound_text}; {label}" if bound_text else f"limited by {label}"
    line = (f"{lead}: {why}; {ttft_text}: queued P99 {queued:.0f} ms, prefill P99 {prefill:.0f} ms; "
            f"KV peak {kv:.0%}, {preemptions} preemptions")
    return Diagnosis(label, line)
