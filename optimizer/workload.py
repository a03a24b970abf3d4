"""Pure: a workload spec -> a deterministic list of requests.

Arrival gaps are drawn once at 1 request/s and scaled by the offered rate, so every rate of every trial
replays the same requests in the same order with the same relative spacing: only the pace changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from optimizer.config import WorkloadSpec

# Token ids are drawn above this value to stay clear of special tokens (bos, eos, pad) of common vocabularies.
_FIRST_TOKEN_ID = 100


@dataclass(frozen=True)
class Request:
    """One request: its prompt, how many tokens to generate, and its arrival at 1 request/s."""

    index: int
    prompt_token_ids: tuple[int, ...]
    output_len: int
    unit_arrival_s: float

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Workload:
    """The measured requests and the warm-up requests of a study."""

    requests: tuple[Request, ...]
    warmup: tuple[Request, ...]

    def arrivals_s(self, rate_rps: float) -> list[float]:
        """Send offsets of the measured requests at `rate_rps` (all at 0 for an infinite rate)."""
        if rate_rps == float("inf"):
            return [0.0] * len(self.requests)
        return [r.unit_arrival_s / rate_rps for r in self.requests]


def _draw(rng: np.random.Generator, count: int, spec: WorkloadSpec, vocab_size: int, start: int) -> list[Request]:
    inputs = rng.integers(spec.input_len_min, spec.input_len_max + 1, size=count)
    outputs = rng.integers(spec.output_len_min, spec.output_len_max + 1, size=count)
    if spec.burstiness == 1.0:
        gaps = rng.exponential(1.0, size=count)
    else:  # gamma gaps of mean 1, as `vllm bench serve --burstiness`: shape < 1 clusters arrivals in bursts
        gaps = rng.gamma(shape=spec.burstiness, scale=1.0 / spec.burstiness, size=count)
    if count:
        gaps[0] = 0.0  # the first request opens the replay
    arrivals = np.cumsum(gaps)
    if count > 1 and arrivals[-1] > 0:
        # Normalize the sample to exactly 1 request/s, so that a replay at rate r really sends at r.
        arrivals *= (count - 1) / arrivals[-1]
    if spec.long_prompt_fraction > 0 and count:
        long = rng.random(count) < spec.long_prompt_fraction
        inputs[long] = rng.integers(spec.long_input_len_min, spec.long_input_len_max + 1, size=int(long.sum()))
    high = max(vocab_size, _FIRST_TOKEN_ID + 2)
    return [
        Request(
            index=start + i,
            prompt_token_ids=tuple(int(t) for t in rng.integers(_FIRST_TOKEN_ID, high, size=int(inputs[i]))),
            output_len=int(outputs[i]),
            unit_arrival_s=float(arrivals[i]),
        )
        for i in range(count)
    ]


def _from_trace(rng: np.random.Generator, spec: WorkloadSpec, vocab_size: int) -> list[Request]:
    rows = spec.trace[: spec.num_requests] if spec.trace else []
    count = len(rows)
    if rows[0][2] is not None:
        arrivals = np.asarray([r[2] for r in rows], dtype=float) - float(rows[0][2])  # the trace's own rhythm
    else:
        gaps = rng.exponential(1.0, size=count)
        gaps[0] = 0.0
        arrivals = np.cumsum(gaps)
    if arrivals[-1] > 0:
        arrivals *= (count - 1) / arrivals[-1]  # rescaled to 1 request/s, then to each offered rate
    high = max(vocab_size, _FIRST_TOKEN_ID + 2)
    return [Request(index=i, prompt_token_ids=tuple(int(t) for t in rng.integers(_FIRST_TOKEN_ID, high, size=inp)),
                    output_len=out, unit_arrival_s=float(arrivals[i])) for i, (inp, out, _) in enumerate(rows)]


def build_workload(spec: WorkloadSpec, vocab_size: int) -> Workload:
    """The study's workload. Same spec and vocabulary size give the same requests, token for token."""
    rng = np.random.default_rng(spec.seed)
    if spec.trace:
        measured = _from_trace(rng, spec, vocab_size)
    else:
        measured = _draw(rng, spec.num_requests, spec, vocab_size, start=0)
    warm_rng = np.random.default_rng([spec.seed, 1])  # independent stream: warm-up never shifts measured draws
    warmup = _draw(warm_rng, spec.warmup_requests, spec, vocab_size, start=len(measured))
    return Workload(requests=tuple(measured), warmup=tuple(warmup))
