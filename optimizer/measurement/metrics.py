"""Pure metric math over per-request records, with the definitions of `vllm bench serve`.

TTFT = first token - send; E2E latency = last token - send; TPOT = (E2E - TTFT) / (output tokens - 1);
ITL pools every gap between consecutive token chunks of every request. Throughputs divide by the replay's
duration (first send to last finish). Percentiles use numpy's linear interpolation, as vLLM does. Latency
distributions may leave out the first and last requests in send order (ramp-up, drain: `measured_window`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from optimizer.measurement.evidence import falls_behind

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds on the replay's clock."""

    index: int
    input_len: int
    planned_s: float
    sent_s: float
    first_token_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    ok: bool = False
    error: str = ""

    @property
    def finish_s(self) -> float | None:
        return self.chunk_times_s[-1] if self.chunk_times_s else None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.sent_s

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency, in milliseconds."""

    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p95_ms: float = math.nan
    p99_9_ms: float = math.nan

    @classmethod
    def of_seconds(cls, values_s: list[float]) -> Distribution:
        if not values_s:
            nan = float("nan")
            return cls(nan, nan, nan, nan, nan, nan)
        arr_ms = np.asarray(values_s, dtype=float) * 1000.0
        p50, p90, p99, p95, p99_9 = (float(np.percentile(arr_ms, q)) for q in (*PERCENTILES, 95, 99.9))
        return cls(float(arr_ms.mean()), p50, p90, p99, p95, p99_9)

    def stat_ms(self, stat: str) -> float:
        """'p99', 'p99.9', 'mean', ...: the statistic, NaN when this summary does not hold it."""
        name = "mean_ms" if stat == "mean" else f"{stat.replace('.', '_')}_ms"
        return float(getattr(self, name, math.nan))

    def stats(self) -> dict[str, float | None]:
        """Every statistic it holds, by the name a limit gives it ('p99.9'), JSON-safe (NaN: None)."""
        out = {"mean": self.mean_ms, "p50": self.p50_ms, "p90": self.p90_ms, "p95": self.p95_ms,
               "p99": self.p99_ms, "p99.9": self.p99_9_ms}
        return {k: round(v, 3) if math.isfinite(v) else None for k, v in out.items()}


@dataclass(frozen=True)
class ReplayMetrics:
    """Summary of one replay of a workload at one offered rate."""

    offered_rate_rps: float  # nominal Poisson rate; inf for a burst
    achieved_rate_rps: float  # completions per second while requests were completing
    sent_rate_rps: float  # requests per second actually sent (differs from offered by sampling)
    completed: int
    failed: int
    duration_s: float
    request_throughput_rps: float
    output_throughput_tok_s: float
    total_token_throughput_tok_s: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    total_input_tokens: int = 0  # prompt tokens of the completed requests, as vLLM's `total_input_tokens`
    falls_behind: bool = False  # the backlog grew over the arrivals' window (evidence.falls_behind)

    @property
    def sustained(self) -> bool:
        """True when every request completed and the engine kept pace with the arrivals: its backlog did not grow
        while requests arrived (judged on the arrivals' window, never on the last request's drain)."""
        return self.completed > 0 and not self.failed and not self.falls_behind

    def to_dict(self) -> dict:
        return asdict(self)


def _rate(count: int, span_s: float) -> float:
    if count <= 0:
        return 0.0
    return float("inf") if span_s <= 0 else count / span_s


def measured_window(records: list[RequestRecord], skip_first_fraction: float = 0.0,
                    skip_last_fraction: float = 0.0) -> list[RequestRecord]:
    """The records left after dropping the first and last fractions of the requests in send order (ramp-up and
    drain); floor(fraction x n) requests at each end."""
    n = len(records)
    first = math.floor(skip_first_fraction * n + 1e-9)
    last = math.floor(skip_last_fraction * n + 1e-9)
    in_send_order = sorted(records, key=lambda r: (r.sent_s, r.index))
    return in_send_order[first:n - last]


def summarize(records: list[RequestRecord], offered_rate_rps: float, skip_first_fraction: float = 0.0,
              skip_last_fraction: float = 0.0) -> ReplayMetrics:
    """Summarize one replay's records. Failed requests count in `failed` and nowhere else.

    Counts, rates and throughputs use every request; the latency distributions only the window that
    `measured_window` leaves (all of them by default).
    """
    ok = [r for r in records if r.ok and r.first_token_s is not None]
    failed = len(records) - len(ok)
    if records:
        start_s = min(r.sent_s for r in records)
        end_s = max([r.finish_s for r in ok if r.finish_s is not None] or [start_s])
    else:
        start_s = end_s = 0.0
    duration_s = max(end_s - start_s, 0.0)
    sends = sorted(r.sent_s for r in records)
    finishes = sorted(r.finish_s for r in ok if r.finish_s is not None)
    # Rates between first and last event: the common latency offset cancels out.
    sent_rate = _rate(len(sends) - 1, sends[-1] - sends[0]) if len(sends) > 1 else float("inf")
    achieved_rate = _rate(len(finishes) - 1, finishes[-1] - finishes[0]) if len(finishes) > 1 else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    window = ok
    if skip_first_fraction or skip_last_fraction:
        kept = {id(r) for r in measured_window(records, skip_first_fraction, skip_last_fraction)}
        window = [r for r in ok if id(r) in kept]
    tpots = [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in window
        if r.output_tokens > 1 and r.e2e_s is not None and r.ttft_s is not None
    ]
    itls = [b - a for r in window for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:])]
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    return ReplayMetrics(
        offered_rate_rps=offered_rate_rps,
        achieved_rate_rps=achieved_rate,
        sent_rate_rps=sent_rate,
        completed=len(ok),
        failed=failed,
        duration_s=duration_s,
        request_throughput_rps=per_s(len(ok)),
        output_throughput_tok_s=per_s(out_tokens),
        total_token_throughput_tok_s=per_s(out_tokens + in_tokens),
        ttft=Distribution.of_seconds([r.ttft_s for r in window if r.ttft_s is not None]),
        tpot=Distribution.of_seconds(tpots),
        itl=Distribution.of_seconds(itls),
        e2e=Distribution.of_seconds([r.e2e_s for r in window if r.e2e_s is not None]),
        total_input_tokens=in_tokens,
        falls_behind=falls_behind(records),
    )
