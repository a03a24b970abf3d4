"""The workload a study replays, as settings: request count, length distributions (one or a
mix), arrivals, prefixes, a trace. Validated at the edge; `measurement/workload.py` draws the requests."""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from optimizer.config.strict import StrictModel

Dist = Literal["uniform", "normal", "lognormal"]
Arrivals = Literal["poisson", "constant", "closed_loop"]


class LengthDist(StrictModel):
    """Token lengths between `min` and `max`: uniform, or a normal / lognormal of `mean` and `std` clipped to them."""

    min: int = Field(ge=1, description="Shortest length, tokens (the clip of normal and lognormal).")
    max: int = Field(ge=1, description="Longest length, tokens (the clip of normal and lognormal).")
    dist: Dist = Field("uniform", description="uniform over [min, max], or normal / lognormal clipped to it.")
    mean: float | None = Field(None, description="Mean of the unclipped normal or lognormal, tokens.")
    std: float | None = Field(None, gt=0, description="Standard deviation of the unclipped distribution, tokens.")

    @model_validator(mode="after")
    def _valid(self) -> LengthDist:
        _check_length(self.min, self.max, self.dist, self.mean, self.std, "")
        return self

    def draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """`size` whole lengths; uniform draws exactly as the workload always has (`integers(min, max + 1)`)."""
        if self.dist == "uniform":
            return rng.integers(self.min, self.max + 1, size=size)
        assert self.mean is not None and self.std is not None
        if self.dist == "normal":
            raw = rng.normal(self.mean, self.std, size=size)
        else:
            mu, sigma = _lognormal_params(self.mean, self.std)
            raw = rng.lognormal(mu, sigma, size=size)
        return np.clip(np.rint(raw), self.min, self.max).astype(np.int64)

    def expected(self) -> float:
        """Mean of the drawn lengths (the clip included, rounding ignored)."""
        if self.dist == "uniform":
            return (self.min + self.max) / 2
        assert self.mean is not None and self.std is not None
        a, b = float(self.min), float(self.max)
        if self.dist == "normal":
            m, s = self.mean, self.std
            za, zb = (a - m) / s, (b - m) / s
            inside = m * (_phi_cdf(zb) - _phi_cdf(za)) - s * (_phi_pdf(zb) - _phi_pdf(za))
            return a * _phi_cdf(za) + b * (1 - _phi_cdf(zb)) + inside
        mu, sigma = _lognormal_params(self.mean, self.std)
        za, zb = (math.log(a) - mu) / sigma, (math.log(b) - mu) / sigma
        inside = math.exp(mu + sigma**2 / 2) * (_phi_cdf(zb - sigma) - _phi_cdf(za - sigma))
        return a * _phi_cdf(za) + b * (1 - _phi_cdf(zb)) + inside


class LengthComponent(LengthDist):
    """One component of a length mixture: `weight` of the requests draw their length from it."""

    weight: float = Field(gt=0, le=1, description="Share of requests drawn from this component.")


def _lognormal_params(mean: float, std: float) -> tuple[float, float]:
    sigma2 = math.log1p((std / mean) ** 2)
    return math.log(mean) - sigma2 / 2, math.sqrt(sigma2)


def _phi_cdf(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def _phi_pdf(z: float) -> float:
    return math.exp(-z * z / 2) / math.sqrt(2 * math.pi)


def _check_length(low: int, high: int, dist: str, mean: float | None, std: float | None, prefix: str) -> None:
    if low > high:
        raise ValueError(f"{prefix}min {low} > {prefix}max {high}")
    if dist == "uniform":
        if mean is not None or std is not None:
            raise ValueError(f"{prefix}mean and {prefix}std apply to normal and lognormal lengths: set "
                             f"{prefix}dist to normal or lognormal, or drop them")
        return
    if mean is None or std is None:
        raise ValueError(f"{dist} lengths need {prefix}mean and {prefix}std (tokens), clipped to [{prefix}min, "
                         f"{prefix}max]")
    if std <= 0:
        raise ValueError(f"{prefix}std must be > 0 tokens, got {std}")
    if not low <= mean <= high:
        raise ValueError(f"{prefix}mean {mean:g} must lie between {prefix}min {low} and {prefix}max {high}")


class WorkloadSpec(StrictModel):
    """A mixed-length workload and its arrivals, identical (same seed) for every trial of a study.

    `preset: NAME` fills in the fields of a named preset (optimizer/config/presets.py); fields given beside it win.
    """

    preset: str | None = Field(None, description="Named preset whose fields fill in every field not given "
                                                 "(chat, rag, batch, bursty); stored for the record.")
    num_requests: int = Field(200, ge=10, description="Measured requests per replay (P99 needs ~100+).")
    warmup_requests: int = Field(4, ge=0, description="Requests sent once after engine start, never measured.")
    warmup_load_requests: int = Field(
        300, ge=0, description="Then the first this many measured requests, sent at the trial's first probe rate and "
                               "never measured: an engine's first replays after its start are slower than its later "
                               "ones (docs/measurement.md, 'Warm-up under load'); 0 leaves it out.")
    input_len_min: int = Field(64, ge=1, description="Shortest prompt, tokens (a clip for normal/lognormal).")
    input_len_max: int = Field(512, ge=1, description="Longest prompt, tokens (a clip for normal/lognormal).")
    input_len_dist: Dist = Field("uniform", description="Prompt lengths: uniform over [min, max], or normal / "
                                                        "lognormal of input_len_mean and input_len_std, clipped.")
    input_len_mean: float | None = Field(None, description="Mean prompt length, tokens (normal/lognormal).")
    input_len_std: float | None = Field(None, description="Standard deviation of prompt lengths, tokens.")
    output_len_min: int = Field(100, ge=1, description="Shortest completion, tokens (a clip for normal/lognormal).")
    output_len_max: int = Field(300, ge=1, description="Longest completion, tokens (a clip for normal/lognormal).")
    output_len_dist: Dist = Field("uniform", description="Completion lengths: as input_len_dist.")
    output_len_mean: float | None = Field(None, description="Mean completion length, tokens (normal/lognormal).")
    output_len_std: float | None = Field(None, description="Standard deviation of completion lengths, tokens.")
    input_mixture: list[LengthComponent] = Field(
        default_factory=list, description="Prompt-length components, each taking `weight` of the requests; the "
                                          "input_len_* distribution takes the rest (weights sum to at most 1).")
    output_mixture: list[LengthComponent] = Field(
        default_factory=list, description="Completion-length components, as input_mixture.")
    seed: int = Field(0, ge=0, description="Seed of lengths, token ids and arrival gaps (0 or more).")
    arrivals: Arrivals = Field(
        "poisson", description="poisson (gamma when burstiness != 1), constant (evenly spaced), both at each "
                               "searched rate; or closed_loop: `concurrency` clients, each sending its next request "
                               "when its previous one finishes (no rate search).")
    concurrency: int | None = Field(None, ge=1, description="Clients of closed_loop arrivals.")
    burstiness: float = Field(1.0, gt=0, description="Gamma shape of the arrival gaps, as `vllm bench serve "
                                                     "--burstiness`: 1 is Poisson, below 1 burstier.")
    long_prompt_fraction: float = Field(0.0, ge=0, le=1, description="Share of requests with a long prompt "
                                        "(shorthand for one uniform input_mixture component).")
    long_input_len_min: int | None = Field(None, ge=1, description="Shortest long prompt, tokens.")
    long_input_len_max: int | None = Field(None, ge=1, description="Longest long prompt, tokens.")
    prefix_groups: int = Field(0, ge=0, description="Shared prefixes (e.g. system prompts, documents).")
    prefix_len: int = Field(0, ge=0, description="Tokens of each shared prefix, put before the request's own prompt.")
    prefix_fraction: float = Field(0.0, ge=0, le=1, description="Share of requests whose prompt starts with one of "
                                                                "the shared prefixes (each picks one at random).")
    trace: list[tuple[int, int, float | None]] | None = Field(
        None, description="Rows (input_len, output_len, timestamp_s or null) read from a trace file; replaces the "
                          "length ranges, and its timestamps (if any) replace Poisson gaps, rescaled to each rate.")
    trace_timing: Literal["rescaled", "original"] = Field(
        "rescaled", description="rescaled: the trace's rhythm at each searched rate; original: one replay per trial "
                                "at the trace's own timestamps (no rate search).")
    skip_first_fraction: float = Field(0.0, ge=0, lt=0.5, description="Share of each replay's first requests (in "
                                       "send order) left out of latency percentiles (ramp-up).")
    skip_last_fraction: float = Field(0.0, ge=0, lt=0.5, description="Share of each replay's last requests (in "
                                      "send order) left out of latency percentiles (drain).")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") is not None:
            from optimizer.config.presets import preset_fields

            given = data
            data = {**preset_fields(given["preset"]), **given}
            for side in ("input", "output"):  # uniform over a preset's lognormal: its mean and std do not apply
                if given.get(f"{side}_len_dist") == "uniform":
                    for key in (f"{side}_len_mean", f"{side}_len_std"):
                        if key not in given:
                            data.pop(key, None)
        return data

    @model_validator(mode="after")
    def _ranges(self) -> WorkloadSpec:
        _check_length(self.input_len_min, self.input_len_max, self.input_len_dist, self.input_len_mean,
                      self.input_len_std, "input_len_")
        _check_length(self.output_len_min, self.output_len_max, self.output_len_dist, self.output_len_mean,
                      self.output_len_std, "output_len_")
        if self.long_prompt_fraction > 0:
            if self.long_input_len_min is None or self.long_input_len_max is None:
                raise ValueError("long_prompt_fraction needs long_input_len_min and long_input_len_max")
            if self.long_input_len_min > self.long_input_len_max:
                raise ValueError(f"long_input_len_min {self.long_input_len_min} > long_input_len_max "
                                 f"{self.long_input_len_max}")
        for name, parts in (("input_mixture", self.input_components()), ("output_mixture", self.output_components())):
            share = sum(w for w, _ in parts[1:])
            if share > 1 + 1e-9:
                extra = " with long_prompt_fraction" if name == "input_mixture" and self.long_prompt_fraction else ""
                raise ValueError(f"{name} weights sum to {share:g}{extra}: they must sum to at most 1 (the "
                                 f"{name.split('_')[0]}_len_* distribution takes the rest)")
        if (self.arrivals == "closed_loop") != (self.concurrency is not None):
            raise ValueError("arrivals: closed_loop needs concurrency (clients), and concurrency applies only to "
                             "closed_loop arrivals")
        if self.burstiness != 1.0 and self.arrivals != "poisson":
            raise ValueError(f"burstiness applies to poisson arrivals only, not {self.arrivals}: drop it")
        if self.prefix_fraction > 0 and (self.prefix_groups < 1 or self.prefix_len < 1):
            raise ValueError("prefix_fraction needs prefix_groups >= 1 and prefix_len >= 1 (tokens)")
        if self.prefix_fraction > 0 and self.trace:
            raise ValueError("shared prefixes do not apply to a trace (its input_len is the whole prompt): drop "
                             "prefix_fraction or the trace")
        if self.trace_timing == "original":
            if not self.trace or self.trace[0][2] is None:
                raise ValueError("trace_timing: original needs a trace with timestamps")
            if self.arrivals != "poisson" or self.burstiness != 1.0:
                raise ValueError("trace_timing: original replays the trace's own timestamps: drop arrivals and "
                                 "burstiness")
        if self.skip_first_fraction + self.skip_last_fraction >= 0.5:
            raise ValueError("skip_first_fraction + skip_last_fraction must stay below 0.5: most requests must "
                             "be measured")
        return self

    def input_components(self) -> list[tuple[float, LengthDist]]:
        """(weight, lengths) of the prompts: the input_len_* distribution first, with the weight the others leave."""
        extra: list[tuple[float, LengthDist]] = []
        if self.long_prompt_fraction > 0 and self.long_input_len_min and self.long_input_len_max:
            extra.append((self.long_prompt_fraction,
                          LengthDist(min=self.long_input_len_min, max=self.long_input_len_max)))
        extra += [(c.weight, c) for c in self.input_mixture]
        base = LengthDist.model_construct(min=self.input_len_min, max=self.input_len_max, dist=self.input_len_dist,
                                          mean=self.input_len_mean, std=self.input_len_std)
        return [(max(1.0 - sum(w for w, _ in extra), 0.0), base), *extra]

    def output_components(self) -> list[tuple[float, LengthDist]]:
        """(weight, lengths) of the completions, as `input_components`."""
        extra: list[tuple[float, LengthDist]] = [(c.weight, c) for c in self.output_mixture]
        base = LengthDist.model_construct(min=self.output_len_min, max=self.output_len_max,
                                          dist=self.output_len_dist, mean=self.output_len_mean,
                                          std=self.output_len_std)
        return [(max(1.0 - sum(w for w, _ in extra), 0.0), base), *extra]

    @property
    def prefixed(self) -> bool:
        return self.prefix_fraction > 0 and self.prefix_groups > 0 and self.prefix_len > 0

    @property
    def max_total_len(self) -> int:
        """Longest prompt (shared prefix included) plus longest completion: `max_model_len` may never be below it."""
        if self.trace:
            return max(i + o for i, o, _ in self.trace)
        longest_input = max(d.max for w, d in self.input_components() if w > 1e-12)
        longest_output = max(d.max for w, d in self.output_components() if w > 1e-12)
        return longest_input + (self.prefix_len if self.prefixed else 0) + longest_output

    @property
    def mean_total_len(self) -> float:
        """Mean prompt (shared prefix included) plus mean completion, tokens."""
        if self.trace:
            return sum(i + o for i, o, _ in self.trace) / len(self.trace)
        mean_in = sum(w * d.expected() for w, d in self.input_components())
        mean_out = sum(w * d.expected() for w, d in self.output_components())
        return mean_in + mean_out + (self.prefix_fraction * self.prefix_len if self.prefixed else 0.0)

    @property
    def arrivals_text(self) -> str:
        """How requests arrive, in words: 'Poisson arrivals', 'gamma arrivals (burstiness 0.5)', ..."""
        if self.trace and self.trace_timing == "original":
            return "the trace's own timestamps"
        if self.arrivals == "closed_loop":
            return f"closed loop with {self.concurrency or 1} clients"
        if self.arrivals == "constant":
            return "constant-rate arrivals"
        if self.trace and self.trace[0][2] is not None:
            return "the trace's rhythm, rescaled to each rate"
        return "Poisson arrivals" if self.burstiness == 1.0 else f"gamma arrivals (burstiness {self.burstiness:g})"

    def describe(self) -> str:
        """One line a person reads: arrivals, requests per replay, lengths (means), shared prefixes."""
        if self.trace:
            lengths = f"lengths from a trace of {len(self.trace)} rows"
        else:
            mean_in = sum(w * d.expected() for w, d in self.input_components())
            mean_out = sum(w * d.expected() for w, d in self.output_components())
            lengths = (f"inputs {self.input_len_min}-{self.input_len_max} tokens, outputs {self.output_len_min}-"
                       f"{self.output_len_max} tokens (means {mean_in:.0f} and {mean_out:.0f} over every component)")
        prefix = (f", {self.prefix_fraction:.0%} of prompts start with one of {self.prefix_groups} shared "
                  f"{self.prefix_len}-token prefixes" if self.prefixed else "")
        preset = f"preset {self.preset}: " if self.preset else ""
        return f"{preset}{self.arrivals_text}, {self.num_requests} requests per replay, {lengths}{prefix}, seed {self.seed}"


# Chat traffic scaled down so that a 2-core CPU serves it at a few requests per second.
CPU_DEMO_WORKLOAD = dict(num_requests=1000, input_len_min=32, input_len_max=256, output_len_min=16, output_len_max=64)
