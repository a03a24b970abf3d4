"""A study written directly with Optuna's API, with hand-made curves whose answers can be checked by hand.

Searched limit 100 ms. Every request yields 100 output tokens, so output tok/s = 100 x the request rate.

    trial 0 (baseline)  burst 10.0/s 900ms | 6.0 400ms | 3.6 90ms | 4.8 150ms | 4.2 98ms
    trial 1             burst 12.0/s 800ms | 7.2 300ms | 4.32 80ms | 5.76 99ms | 6.48 130ms
    trial 2             burst 11.0/s 700ms | 6.6 60ms  | 8.8 200ms | 7.7 97ms
    trial 3             burst  5.0/s 600ms | 3.0 20ms  | 4.0 400ms | 3.5 30ms
    trial 4             pruned: out of memory, no curve

At 100 ms: #0 4.2/s (420 tok/s, 98ms), #1 5.76/s (576, 99ms), #2 7.7/s (770, 97ms), #3 3.5/s (350, 30ms).
Front: #2, #3 (#0 and #1 are dominated by #2). Recommended #2, +83.3% over the baseline.
"""

from __future__ import annotations

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from optimizer.config.settings import StudyConfig
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.search.objective import CONSTRAINT
from optimizer.search.attrs import BASELINE_NOTE, STUDY_CONFIG
from optimizer.search.measured import SCHEMA, TrialMeasurement
from optimizer.search.study import DIRECTIONS

LIMIT_MS = 100.0
TOKENS_PER_REQUEST = 100

CURVES = {
    0: [(None, 900, 10.0), (6.0, 400), (3.6, 90), (4.8, 150), (4.2, 98)],
    1: [(None, 800, 12.0), (7.2, 300), (4.32, 80), (5.76, 99), (6.48, 130)],
    2: [(None, 700, 11.0), (6.6, 60), (8.8, 200), (7.7, 97)],
    3: [(None, 600, 5.0), (3.0, 20), (4.0, 400), (3.5, 30)],
}
PARAMS = {
    1: {"max_num_seqs": 64, "gpu_memory_utilization": 0.8, "enable_chunked_prefill": True},
    2: {"max_num_seqs": 128, "gpu_memory_utilization": 0.9, "enable_chunked_prefill": True},
    3: {"max_num_seqs": 8, "gpu_memory_utilization": 0.7, "enable_chunked_prefill": False},
    4: {"max_num_seqs": 256, "gpu_memory_utilization": 0.95, "enable_chunked_prefill": False},
}
BASELINE_ENGINE = {"max_num_seqs": 256, "gpu_memory_utilization": 0.9, "enable_chunked_prefill": True,
                   "max_num_batched_tokens": 2048}
DISTRIBUTIONS = {"max_num_seqs": IntDistribution(1, 512, log=True),
                 "gpu_memory_utilization": FloatDistribution(0.5, 0.95),
                 "enable_chunked_prefill": CategoricalDistribution([True, False])}


def point(rate_rps: float | None, ttft_p99_ms: float, burst_rps: float | None = None) -> dict:
    """A stored curve point; a burst (rate None) completes at `burst_rps`."""
    req_rps = burst_rps if rate_rps is None else rate_rps
    return {"offered_rate_rps": rate_rps, "sent_rate_rps": None if rate_rps is None else rate_rps,
            "achieved_rate_rps": req_rps, "output_throughput_tok_s": req_rps * TOKENS_PER_REQUEST,
            "request_throughput_rps": req_rps, "ttft_p50_ms": ttft_p99_ms / 2, "ttft_p99_ms": float(ttft_p99_ms),
            "tpot_p99_ms": 5.0, "completed": 40, "failed": 0, "sustained": True,
            "feasible": ttft_p99_ms <= LIMIT_MS,
            "stats": {"ttft": {"p50": ttft_p99_ms / 2, "p99": float(ttft_p99_ms)}, "tpot": {"p99": 5.0}}}


def stored(curve: list[dict] | None = None, **result) -> dict:
    """A trial's stored measurement as its objective writes it (search/measured.py): the `curve` and `result` user
    attributes, the result of the current schema with the given fields."""
    return {"curve": list(curve or []), "result": {"schema": SCHEMA, **result}}


def measurement(curve: list[dict] | None = None, **result) -> TrialMeasurement:
    """The typed measurement of `stored(curve, **result)`."""
    attrs = stored(curve, **result)
    return TrialMeasurement.from_stored(attrs["result"], attrs["curve"])


def curve(n: int) -> list[dict]:
    return [point(r[0], r[1], r[2] if len(r) > 2 else None) for r in CURVES[n]]


def make_config(tmp_path, name: str = "syn", device: str = "cpu") -> StudyConfig:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    return StudyConfig(study_name=name, storage_url=f"sqlite:///{tmp_path}/{name}.db", ttft_p99_ms=LIMIT_MS,
                       budget=5, model=str(model), dummy_weights=True, device=device,
                       workload=WorkloadSpec(num_requests=40, warmup_requests=2, input_len_min=64,
                                             input_len_max=256, output_len_min=90, output_len_max=110),
                       engine_args={"enforce_eager": True})


FALLBACK_NOTE = ("vLLM's default gpu_memory_utilization (0.9) does not fit on this CPU machine (asks for 9.2 GiB, "
                 "7.0 GiB free); the baseline keeps vLLM's scheduler defaults with gpu_memory_utilization=0.3")


def build(tmp_path, name: str = "syn", device: str = "cpu",
          baseline_note: str | None = None) -> tuple[optuna.Study, StudyConfig]:
    """Write the study above into `tmp_path/<name>.db` and return it with its config. `baseline_note`: the baseline
    ran with this machine's fallback memory fraction (0.3), and says why (e.g. FALLBACK_NOTE)."""
    config = make_config(tmp_path, name, device)
    study = optuna.create_study(study_name=name, storage=config.storage_url, directions=DIRECTIONS)
    STUDY_CONFIG.set(study, config.model_dump_json())
    trials = []
    for n in range(4):
        c = curve(n)
        best = max((p for p in c if p["feasible"]), key=lambda p: p["offered_rate_rps"] or float("inf"))
        params = PARAMS.get(n, {})
        engine = BASELINE_ENGINE if n == 0 else {**BASELINE_ENGINE, **params}
        result = {"feasible": True, "rate_rps": best["offered_rate_rps"],
                  **{k: best[k] for k in ("output_throughput_tok_s", "request_throughput_rps", "ttft_p50_ms",
                                          "ttft_p99_ms", "tpot_p99_ms")}}
        attrs = {**stored(c, **result), "engine_config": engine, "engine_params": params}
        if n == 0:
            attrs["baseline"] = True
            if baseline_note is not None:
                attrs["engine_config"] = {**engine, "gpu_memory_utilization": 0.3}
                attrs[BASELINE_NOTE.key] = baseline_note
        trials.append(optuna.trial.create_trial(
            values=[best["output_throughput_tok_s"], best["ttft_p99_ms"]], params=params,
            distributions={k: DISTRIBUTIONS[k] for k in params}, user_attrs=attrs, constraints={CONSTRAINT: 0.0}))
    trials.append(optuna.trial.create_trial(
        state=TrialState.PRUNED, params=PARAMS[4], distributions=DISTRIBUTIONS, constraints={CONSTRAINT: 1e7},
        user_attrs={"pruned_reason": "out_of_memory", "pruned_detail": "CUDA out of memory",
                    "engine_params": PARAMS[4]}))
    study.add_trials(trials)
    return study, config
