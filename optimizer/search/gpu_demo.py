"""How long the embedded GPU demo (config/demo.py) takes on one H100: an estimate, not a measurement.

Worked out from the phases of a vLLM engine's start that its CUDA build logs (docs/gpu.md, "A GPU trial's time, on
paper"), scaled to a 1B model with dummy weights, and from an assumed rate at the limit; the study's shape (search
trials, confirmation runs, their replays in units of one probe at the cap) is the one the CPU demo's estimate uses
(search/probe.py). On a GPU the engine's start weighs most: torch.compile and CUDA graph capture run again for
nearly every trial, because vLLM's compile cache key holds the searched parameters.
"""

from __future__ import annotations

from optimizer.config.settings import StudyConfig
from optimizer.search.probe import BASELINE_EXTRA_REPLAYS, CONFIRM_REPLAYS, REPLAYS_PER_TRIAL
from optimizer.search.split import plan

# Seconds (least, most) of each phase of one engine start and shutdown of the GPU demo on one H100
START_PHASES_S: dict[str, tuple[float, float]] = {
    "processes spawn, import torch and vllm": (10.0, 15.0),
    "dummy weights (2.5 GB, filled on the GPU)": (1.0, 3.0),
    "memory profile and KV cache": (3.0, 8.0),
    "torch.compile": (15.0, 40.0),
    "CUDA graph capture": (5.0, 20.0),
    "shutdown": (3.0, 8.0),
}
# Assumed requests per second at a 150 ms TTFT P99 limit, chat lengths (means 400 in, 250 out), from the rates an 8B
# model holds on one such GPU (docs/gpu.md) and a 1B model's ~4x fewer bytes and FLOPs per token, less per-step
# overheads that do not shrink with it
RATE_AT_LIMIT_RPS = (40.0, 80.0)
GPU = "one H100"


def start_s() -> tuple[float, float]:
    """Pure: one engine start and shutdown of the GPU demo, least and most, seconds."""
    return sum(low for low, _ in START_PHASES_S.values()), sum(high for _, high in START_PHASES_S.values())


def estimate_s(config: StudyConfig) -> tuple[float, float] | None:
    """Pure: the least and most seconds `config`'s study takes on one H100 where it runs the GPU demo's model, every
    confirmation round planned run (the rounds stop earlier once they decide); None without a trial budget (a
    deadline decides then)."""
    if config.budget is None:
        return None
    split = plan(config.budget, config.confirm, config.serves_after)
    search = split.search_budget or 0
    bounds = []
    for start, rate in zip(start_s(), reversed(RATE_AT_LIMIT_RPS)):
        probe = config.workload.num_requests / rate
        fixed = start + config.workload.warmup_load_requests / rate
        bounds.append(search * (fixed + REPLAYS_PER_TRIAL * probe) + BASELINE_EXTRA_REPLAYS * probe
                      + split.runs * (fixed + CONFIRM_REPLAYS * probe))
    return bounds[0], bounds[1]


def estimate_text(config: StudyConfig) -> str | None:
    """'about 60-130 min on one H100 (an estimate from vLLM's start-up phases, not a measurement)'; None without a
    trial budget."""
    found = estimate_s(config)
    if found is None:
        return None
    low, high = (round(s / 60 / 5) * 5 for s in found)
    return f"about {low}-{high} min on {GPU} (an estimate from vLLM's start-up phases, not a measurement)"


def model_line(config: StudyConfig, path: str, new_study: bool = True) -> str:
    """The start's line on the GPU demo's model, with the study's estimate on one H100 where it is new and runs on
    cuda with a trial budget."""
    line = (f"model: embedded default {config.model} (Llama-3.2-1B's config.json, random weights: vLLM's "
            f"load_format=dummy) at {path}")
    estimate = estimate_text(config) if new_study and config.device == "cuda" else None
    return line + (f"; this study takes {estimate}" if estimate else "")
