"""Named workloads for what people serve: `--preset NAME` or `preset: NAME` in the workload YAML.

Each preset has two scales: `fields` for a real model on a GPU, and `cpu_demo` for the embedded default model on a
2-core CPU (contexts of 2048 tokens, a few requests per second), used when no `--model` is given. Fields given
beside a preset (flags, YAML) override the preset's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from optimizer.core.errors import UsageError


@dataclass(frozen=True)
class Preset:
    name: str
    summary: str
    fields: dict[str, Any]
    cpu_demo: dict[str, Any]


_CHAT_LENGTHS = dict(input_len_dist="lognormal", input_len_min=16, input_len_max=2048, input_len_mean=400,
                     input_len_std=300, output_len_dist="lognormal", output_len_min=16, output_len_max=1024,
                     output_len_mean=250, output_len_std=150)
_CHAT_DEMO_LENGTHS = dict(input_len_dist="lognormal", input_len_min=32, input_len_max=256, input_len_mean=100,
                          input_len_std=60, output_len_dist="lognormal", output_len_min=16, output_len_max=64,
                          output_len_mean=36, output_len_std=14)
_NO_PREFIX = dict(prefix_groups=0, prefix_len=0, prefix_fraction=0.0)
_POISSON = dict(arrivals="poisson", burstiness=1.0)

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("chat", "interactive chat: Poisson arrivals, lognormal prompts (mean 400) and answers (mean 250)",
           fields=dict(num_requests=300, **_CHAT_LENGTHS, **_NO_PREFIX, **_POISSON),
           cpu_demo=dict(num_requests=120, **_CHAT_DEMO_LENGTHS, **_NO_PREFIX, **_POISSON)),
    Preset("rag", "long-prompt RAG: 70% of prompts open with one of 8 shared 1024-token documents, long own "
                  "prompts (30% of them 2-4k tokens), short answers",
           fields=dict(num_requests=300, input_len_dist="lognormal", input_len_min=128, input_len_max=2048,
                       input_len_mean=800, input_len_std=400,
                       input_mixture=[dict(weight=0.3, min=2048, max=4096)],
                       output_len_dist="uniform", output_len_min=32, output_len_max=256,
                       prefix_groups=8, prefix_len=1024, prefix_fraction=0.7, **_POISSON),
           cpu_demo=dict(num_requests=120, input_len_dist="lognormal", input_len_min=32, input_len_max=384,
                         input_len_mean=160, input_len_std=80,
                         input_mixture=[dict(weight=0.3, min=384, max=768)],
                         output_len_dist="uniform", output_len_min=16, output_len_max=48,
                         prefix_groups=4, prefix_len=256, prefix_fraction=0.7, **_POISSON)),
    Preset("batch", "offline batch: medium prompts, long outputs (lognormal, mean 1000 tokens); set a TTFT limit "
                    "of seconds",
           fields=dict(num_requests=300, input_len_dist="uniform", input_len_min=128, input_len_max=1024,
                       output_len_dist="lognormal", output_len_min=256, output_len_max=2048, output_len_mean=1000,
                       output_len_std=400, **_NO_PREFIX, **_POISSON),
           cpu_demo=dict(num_requests=100, input_len_dist="uniform", input_len_min=32, input_len_max=256,
                         output_len_dist="lognormal", output_len_min=48, output_len_max=256, output_len_mean=128,
                         output_len_std=48, **_NO_PREFIX, **_POISSON)),
    Preset("bursty", "chat lengths with bursty arrivals (gamma shape 0.25: gaps with a coefficient of variation "
                     "of 2)",
           fields=dict(num_requests=300, **_CHAT_LENGTHS, **_NO_PREFIX, arrivals="poisson", burstiness=0.25),
           cpu_demo=dict(num_requests=120, **_CHAT_DEMO_LENGTHS, **_NO_PREFIX, arrivals="poisson",
                         burstiness=0.25)),
)}


def get(name: str) -> Preset:
    """The preset called `name`, or a UsageError that lists the names."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise UsageError(f"unknown workload preset {name!r}: choose one of {', '.join(PRESETS)}") from None


def preset_fields(name: str) -> dict[str, Any]:
    """The workload fields of preset `name` at full scale (a ValueError inside pydantic validation)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    return dict(PRESETS[name].fields)


def demo_workload(workload: dict[str, Any], default: dict[str, Any]) -> dict[str, Any]:
    """Workload fields for the embedded CPU demo: the preset's CPU scale (or `default` without a preset) under
    the fields given explicitly."""
    name = workload.get("preset")
    base = default if name is None else get(name).cpu_demo
    return {**base, **workload}
