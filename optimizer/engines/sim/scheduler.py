"""Pure: one step at a time, what vLLM V1's scheduler would run, with no notion of time.

Modelled after vllm/v1/core/sched/scheduler.py (FCFS policy):
- a token budget of `max_num_batched_tokens` per step; running requests are served first (one token each when
  decoding, the rest of their prompt when prefilling), then waiting requests are admitted in arrival order while
  fewer than `max_num_seqs` run and budget is left;
- chunked prefill: a prompt larger than the budget left is split over steps; without it such a prompt waits
  (and blocks the queue behind it) until a step has room for all of it;
- `long_prefill_token_threshold` caps the prompt tokens one request may take in a step (0: no cap), when more
  than one request is running or waiting;
- KV cache in blocks of `block_size` tokens, `num_kv_blocks` of them; when a running request cannot get a
  block, the last admitted running request is preempted: its blocks are freed and it waits again at the front,
  to recompute everything it had (prompt and generated tokens);
- prefix caching: full prompt blocks are identified by a hash chain of their tokens; a new request skips the
  cached full blocks of its prompt (never its last token), and blocks of finished requests stay cached until
  evicted, least recently used first.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from optimizer.measurement.workload import Request


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_kv_blocks: int
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0

    @classmethod
    def of(cls, resolved: dict[str, Any]) -> SchedulerConfig:
        return cls(**{k: resolved[k] for k in cls.__dataclass_fields__ if k in resolved})


@dataclass(eq=False, slots=True)
class Seq:
    """One request inside the scheduler."""

    request: Request
    key: Any = None  # the caller's handle, returned with every token
    num_tokens: int = 0  # prompt + generated tokens
    computed: int = 0  # tokens whose KV is in the cache
    generated: int = 0
    blocks: list[Any] = field(default_factory=list)
    hashes: list[int] | None = None  # hash chain of the prompt's full blocks (prefix caching)
    preemptions: int = 0
    started: bool = False  # scheduled since it (last) entered the running set

    def __post_init__(self) -> None:
        self.num_tokens = self.request.input_len + self.generated

    @property
    def done(self) -> bool:
        return self.generated >= self.request.output_len


@dataclass
class StepPlan:
    """What one step runs: the time model's inputs, and per sequence how many tokens it computes."""

    scheduled: list[tuple[Seq, int]]
    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    preempted: int
    prefill_attention: float = 0.0  # sum over prefill chunks of n * (cached + n / 2): token pairs attended
    new_requests: int = 0  # requests whose prefill starts in this step

    @property
    def time_inputs(self) -> tuple[int, int, int, float, int]:
        """The arguments of `StepTimeModel.step_s`, in order."""
        return (self.prefill_tokens, self.decode_seqs, self.context_tokens, self.prefill_attention,
                self.new_requests)


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    peak_running: int = 0
    peak_waiting: int = 0
    peak_kv_usage: float = 0.0
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        if config.num_kv_blocks < 1 or config.block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.config = config
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.stats = SchedulerStats()
        self._ref: dict[Any, int] = {}  # blocks held by a running sequence -> how many hold it
        self._cached: OrderedDict[Any, None] = OrderedDict()  # idle blocks kept for prefix hits, LRU first
        self._fresh = 0  # id source for blocks that no prefix can share
        self._threshold = config.long_prefill_token_threshold

    # -- KV blocks ---------------------------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        return len(self._ref)

    def _take_block(self, key: Any) -> bool:
        if key in self._ref:
            self._ref[key] += 1
            return True
        if key in self._cached:
            del self._cached[key]
        elif self.used_blocks + len(self._cached) >= self.config.num_kv_blocks:
            if not self._cached:
                return False
            self._cached.popitem(last=False)  # evict the least recently used idle block
        self._ref[key] = 1
        return True

    def _release(self, seq: Seq, keep_cached: bool) -> None:
        for key in reversed(seq.blocks):  # the tail is evicted first, as vLLM frees blocks
            n = self._ref[key] - 1
            if n:
                self._ref[key] = n
                continue
            del self._ref[key]
            if keep_cached and isinstance(key, tuple):
                self._cached[key] = None
        seq.blocks = []

    def _block_key(self, seq: Seq, index: int) -> Any:
        if self.config.enable_prefix_caching and seq.hashes is not None and index < len(seq.hashes):
            return ("h", seq.hashes[index])
        self._fresh += 1
        return self._fresh

    def _allocate(self, seq: Seq, new_tokens: int) -> bool:
        if seq.computed + new_tokens <= len(seq.blocks) * self.config.block_size:
            return True  # the common decode step: its last block has room
        need = math.ceil((seq.computed + new_tokens) / self.config.block_size)
        while len(seq.blocks) < need:
            key = self._block_key(seq, len(seq.blocks))
            if not self._take_block(key):
                return False
            seq.blocks.append(key)
        return True

    def reset_prefix_cache(self) -> None:
        self._cached.clear()

    # -- requests ----------------------------------------------------------------------------------------
    def add(self, request: Request, key: Any = None) -> Seq:
        seq = Seq(request, key)
        if self.config.enable_prefix_caching:
            seq.hashes = _hash_chain(request.prompt_token_ids, self.config.block_size)
        self.waiting.append(seq)
        return seq

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _prefix_hit(self, seq: Seq) -> int:
        """Tokens of `seq`'s prompt already cached: whole blocks, never the last token (it must be computed)."""
        if not seq.hashes or seq.generated:
            return 0
        hit = 0
        for h in seq.hashes:
            key = ("h", h)
            if key not in self._ref and key not in self._cached:
                break
            hit += 1
        tokens = hit * self.config.block_size
        while tokens >= seq.num_tokens:
            tokens -= self.config.block_size
        return max(tokens, 0)

    def _preempt_last(self) -> Seq:
        victim = self.running.pop()
        self._release(victim, keep_cached=True)
        victim.computed = 0
        victim.started = False
        victim.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def _cap(self, want: int, budget: int) -> int:
        threshold = self._threshold
        if threshold > 0 and want > threshold:
            want = threshold
        return min(want, budget)

    def plan(self) -> StepPlan:
        """Choose what the next step computes and reserve its KV blocks."""
        budget = self.config.max_num_batched_tokens
        # vLLM applies the long-prefill cap only when another request could use the budget
        self._threshold = self.config.long_prefill_token_threshold if len(self.running) + len(self.waiting) > 1 else 0
        scheduled: list[tuple[Seq, int]] = []
        preempted = 0
        i = 0
        running = self.running
        while i < len(running) and budget > 0:
            seq = running[i]
            want = seq.num_tokens - seq.computed
            n = 1 if want == 1 else self._cap(want, budget)
            if n <= 0:
                i += 1
                continue
            while not self._allocate(seq, n):
                victim = self._preempt_last()
                preempted += 1
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            break  # `seq` itself was preempted: nothing after it runs either
        if not preempted:
            while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
                seq = self.waiting[0]
                hit = self._prefix_hit(seq) if seq.computed == 0 else 0
                seq.computed = max(seq.computed, hit)
                want = seq.num_tokens - seq.computed
                if not self.config.enable_chunked_prefill and self._cap(want, 1 << 62) > budget:
                    break
                n = self._cap(want, budget)
                if not self._allocate(seq, n):
                    self._release(seq, keep_cached=True)
                    seq.computed = 0
                    break
                self.waiting.popleft()
                self.running.append(seq)
                if not seq.generated and not seq.preemptions:
                    self.stats.prefix_hit_tokens += hit
                    self.stats.prompt_tokens += seq.request.input_len
                scheduled.append((seq, n))
                budget -= n
        prefill = decode = context = new = 0
        attention = 0.0
        for seq, n in scheduled:
            context += seq.computed
            if n == 1 and seq.generated and seq.computed == seq.num_tokens - 1:
                decode += 1
            else:
                prefill += n
                attention += n * (seq.computed + n / 2)
            if not seq.started:
                new += 1
                seq.started = True
        st = self.stats
        st.peak_running = max(st.peak_running, len(self.running))
        st.peak_waiting = max(st.peak_waiting, len(self.waiting))
        st.peak_kv_usage = max(st.peak_kv_usage, self.used_blocks / self.config.num_kv_blocks)
        return StepPlan(scheduled, prefill, decode, context, preempted, attention, new)

    def finish(self, plan: StepPlan) -> tuple[list[Seq], list[Seq]]:
        """Apply a planned step: (sequences that produced a token, sequences that completed)."""
        self.stats.steps += 1
        emitted, completed = [], []
        for seq, n in plan.scheduled:
            seq.computed += n
            if seq.computed >= seq.num_tokens:  # its whole context is in: the step samples its next token
                seq.generated += 1
                seq.num_tokens += 1
                emitted.append(seq)
                if seq.done:
                    completed.append(seq)
        if completed:
            gone = set(map(id, completed))
            self.running = [s for s in self.running if id(s) not in gone]
            for seq in completed:
                self._release(seq, keep_cached=True)
        return emitted, completed


def _hash_chain(tokens: tuple[int, ...], block_size: int) -> list[int]:
    out, prev = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prev = hash((prev, tokens[start:start + block_size]))
        out.append(prev)
    return out
