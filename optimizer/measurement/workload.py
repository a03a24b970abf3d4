"""Pure: a workload spec -> a deterministic list of requests.

Arrival gaps are drawn once at 1 request/s and scaled by the offered rate, so every rate of every trial
replays the same requests in the same order with the same relative spacing: only the pace changes.
Draws happen in a fixed order (lengths, gaps, mixture components, shared prefixes, token ids), and a spec
without the newer features draws exactly as the workload always has, so stored studies replay the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from optimizer.config.workload_spec import LengthDist, WorkloadSpec

# Token ids are drawn above this value to stay clear of special tokens (bos, eos, pad) of common vocabularies.
_FIRST_TOKEN_ID = 100


@dataclass(frozen=True)
class Request:
    """One request: its prompt, how many tokens to generate, and its arrival at 1 request/s."""

    index: int
    prompt_token_ids: tuple[int, ...]
    output_len: int
    unit_arrival_s: float
    prefix_group: int | None = None  # which shared prefix the prompt starts with, if any

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Workload:
    """The measured requests and the warm-up requests of a study."""

    requests: tuple[Request, ...]
    warmup: tuple[Request, ...]
    native_rate_rps: float | None = None  # a timestamped trace's own mean rate: its arrivals in real time

    def arrivals_s(self, rate_rps: float) -> list[float]:
        """Send offsets of the measured requests at `rate_rps` (all at 0 for an infinite rate)."""
        if rate_rps == float("inf"):
            return [0.0] * len(self.requests)
        return [r.unit_arrival_s / rate_rps for r in self.requests]


def _mix(rng: np.random.Generator, values: np.ndarray, parts: list[tuple[float, LengthDist]]) -> None:
    """Give each request a component by weight (the first, base one takes what the others leave) and redraw the
    lengths of those that fall in another: one uniform draw per request, then one draw per component."""
    extra = parts[1:]
    if not extra or not len(values):
        return
    u = rng.random(len(values))
    edges = np.cumsum([w for w, _ in extra])
    component = np.searchsorted(edges, u, side="right")  # == len(extra): the base component
    for k, (_, dist) in enumerate(extra):
        chosen = component == k
        values[chosen] = dist.draw(rng, int(chosen.sum()))


def _prefixes(spec: WorkloadSpec, high: int) -> list[tuple[int, ...]]:
    """The shared prefixes, from their own stream: the same for measured and warm-up requests."""
    rng = np.random.default_rng([spec.seed, 2])
    return [tuple(int(t) for t in rng.integers(_FIRST_TOKEN_ID, high, size=spec.prefix_len))
            for _ in range(spec.prefix_groups)]


def _assign_prefixes(rng: np.random.Generator, spec: WorkloadSpec, count: int) -> list[int | None]:
    """Exactly round(prefix_fraction x count) requests, chosen at random, each with a random group."""
    groups: list[int | None] = [None] * count
    if not spec.prefixed or not count:
        return groups
    chosen = rng.choice(count, size=int(round(spec.prefix_fraction * count)), replace=False)
    for i, g in zip(chosen, rng.integers(0, spec.prefix_groups, size=len(chosen))):
        groups[int(i)] = int(g)
    return groups


def _unit_arrivals(rng: np.random.Generator, spec: WorkloadSpec, count: int) -> np.ndarray:
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
    if spec.arrivals == "constant" and spec.burstiness == 1.0:
        # Evenly spaced. The gaps are drawn anyway, so that lengths and tokens equal the Poisson workload's.
        arrivals = np.arange(count, dtype=float)
    # closed_loop keeps the Poisson offsets: its replay ignores them, and a Poisson check at the rate a
    # concurrency reached (optimize verify) replays the same requests
    return arrivals


def _requests(rng: np.random.Generator, spec: WorkloadSpec, inputs: np.ndarray, outputs: list[int],
              arrivals: np.ndarray, vocab_size: int, start: int) -> list[Request]:
    high = max(vocab_size, _FIRST_TOKEN_ID + 2)
    groups = _assign_prefixes(rng, spec, len(outputs))
    shared = _prefixes(spec, high) if spec.prefixed else []
    out = []
    for i in range(len(outputs)):
        own = tuple(int(t) for t in rng.integers(_FIRST_TOKEN_ID, high, size=int(inputs[i])))
        g = groups[i]
        out.append(Request(index=start + i, prompt_token_ids=own if g is None else shared[g] + own,
                           output_len=int(outputs[i]), unit_arrival_s=float(arrivals[i]), prefix_group=g))
    return out


def _draw(rng: np.random.Generator, count: int, spec: WorkloadSpec, vocab_size: int, start: int) -> list[Request]:
    in_parts, out_parts = spec.input_components(), spec.output_components()
    inputs = in_parts[0][1].draw(rng, count)
    outputs = out_parts[0][1].draw(rng, count)
    arrivals = _unit_arrivals(rng, spec, count)
    _mix(rng, inputs, in_parts)
    _mix(rng, outputs, out_parts)
    return _requests(rng, spec, inputs, [int(o) for o in outputs], arrivals, vocab_size, start)


def _from_trace(rng: np.random.Generator, spec: WorkloadSpec, vocab_size: int) -> tuple[list[Request], float | None]:
    rows = spec.trace[: spec.num_requests] if spec.trace else []
    count = len(rows)
    native: float | None = None
    if rows[0][2] is not None and spec.arrivals == "poisson" and spec.burstiness == 1.0:
        arrivals = np.asarray([r[2] for r in rows], dtype=float) - float(rows[0][2])  # the trace's own rhythm
        if arrivals[-1] > 0:
            native = (count - 1) / float(arrivals[-1])
    else:
        arrivals = _unit_arrivals(rng, spec, count)
    if arrivals[-1] > 0:
        arrivals *= (count - 1) / arrivals[-1]  # rescaled to 1 request/s, then to each offered rate
    inputs = np.asarray([r[0] for r in rows])
    return _requests(rng, spec, inputs, [r[1] for r in rows], arrivals, vocab_size, 0), native


def build_workload(spec: WorkloadSpec, vocab_size: int) -> Workload:
    """The study's workload. Same spec and vocabulary size give the same requests, token for token."""
    rng = np.random.default_rng(spec.seed)
    native = None
    if spec.trace:
        measured, native = _from_trace(rng, spec, vocab_size)
    else:
        measured = _draw(rng, spec.num_requests, spec, vocab_size, start=0)
    warm_rng = np.random.default_rng([spec.seed, 1])  # independent stream: warm-up never shifts measured draws
    warmup = _draw(warm_rng, spec.warmup_requests, spec, vocab_size, start=len(measured))
    return Workload(requests=tuple(measured), warmup=tuple(warmup), native_rate_rps=native)


def fixed_load_rate(spec: WorkloadSpec, workload: Workload) -> float | None:
    """The one load a trial measures at when the workload fixes it, or None when the rate is searched:
    infinity for closed-loop clients (they set their own pace), a timestamped trace's own rate for
    `trace_timing: original`."""
    if spec.arrivals == "closed_loop":
        return float("inf")
    if spec.trace_timing == "original":
        return workload.native_rate_rps or float("inf")  # timestamps all equal: a burst
    return None
