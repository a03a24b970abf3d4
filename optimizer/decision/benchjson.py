"""One trial's measurement as the JSON `vllm bench serve --save-result` writes, for tools that read that format.

The keys and their units are vLLM's (vllm/benchmarks/serve.py): throughputs per second, latencies in ms,
`request_rate` a number or "inf". A trial stores a summary per replay, not per-request records, so only the
keys that summary determines are written: `duration`, token totals and request throughput follow from the stored
rates and counts (`total_input_tokens` counts the completed requests' prompts, as vLLM's does, also when some
failed); `median_ttft_ms` is the stored P50; `p99_ttft_ms`, `p99_tpot_ms`, `p99_itl_ms` and `p99_e2el_ms` the
stored P99s. Means, standard deviations and other percentiles were not stored and are left out rather than
guessed. Extra facts (study, trial, the limits the config was tuned for, engine arguments) go in as the
top-level metadata keys that `vllm bench serve --metadata KEY=VALUE` adds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial

from optimizer.config.limits import Limits
from optimizer.config.settings import StudyConfig
from optimizer.core.errors import OptimizerError
from optimizer.decision.decide import Decision
from optimizer.decision.trial import TrialView
from optimizer.search.attrs import BASELINE, ENGINE_CONFIG, PRUNED_REASON
from optimizer.search.study import confirmation_study_name, is_confirmation

# Stored curve keys that are already vLLM result keys under another name.
_SAME_METRIC = {"ttft_p50_ms": "median_ttft_ms", "ttft_p99_ms": "p99_ttft_ms", "tpot_p99_ms": "p99_tpot_ms",
                "itl_p99_ms": "p99_itl_ms", "e2e_p99_ms": "p99_e2el_ms"}
# vLLM result keys a future curve may store under the same name; copied when present.
_OPTIONAL = ("mean_ttft_ms", "std_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "mean_itl_ms",
             "median_itl_ms", "std_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "std_e2el_ms",
             "p99_e2el_ms")


def chosen_point(trial: FrozenTrial, limits: Limits) -> dict[str, Any]:
    """The replay the trial is judged by under `limits`: its qualifying point at the highest offered rate."""
    ranked = TrialView.under(trial, limits).ranked
    if ranked.point is None:
        why = PRUNED_REASON.of(trial)
        raise OptimizerError(
            f"trial #{trial.number} has no stored replay that meets {limits.text}"
            + (f" (it could not run: {why})" if why else "")
            + f": pick another --trial, or pass looser limits than these ({limits.flags})"
        )
    return dict(ranked.point)


def bench_result(trial: FrozenTrial, config: StudyConfig, point: dict[str, Any], limits: Limits) -> dict[str, Any]:
    """`point` (one stored replay of `trial`) in the shape of `vllm bench serve --save-result`, with the `limits` it
    was judged at among the metadata keys (`optimizer_limits`: each {metric, stat, value_ms}, and their goodput
    share; `optimizer_slo`: them in words)."""
    rate = point.get("offered_rate_rps")
    completed, failed = int(point["completed"]), int(point["failed"])
    req_tput = float(point["request_throughput_rps"])
    out_tput = float(point["output_throughput_tok_s"])
    duration_s = completed / req_tput if req_tput > 0 else 0.0
    # the study's model as stored: for the embedded demo, the shape its probe chose (e.g. tiny-llama-7m), not the
    # largest one the probe started from
    model_id = config.model
    when = trial.datetime_complete or trial.datetime_start
    result: dict[str, Any] = {
        "date": when.strftime("%Y%m%d-%H%M%S") if when else None,
        "endpoint_type": "vllm",
        "backend": "vllm",
        "label": f"optimize:{study_of(config.study_name, trial)}#{trial.number}",
        "model_id": model_id,
        "tokenizer_id": model_id,
        "num_prompts": config.workload.num_requests,
        # metadata, as `--metadata KEY=VALUE` would add it
        "optimizer_study": config.study_name,
        "optimizer_trial": trial.number,
        "optimizer_baseline": bool(BASELINE.of(trial)),
        "optimizer_limits": limits.model_dump(mode="json"),
        "optimizer_slo": limits.text,
        "optimizer_sustained": bool(point.get("sustained")),
        "optimizer_engine_args": ENGINE_CONFIG.of(trial),
        "optimizer_workload": config.workload.model_dump(),
        "request_rate": "inf" if rate is None else rate,
        "burstiness": config.workload.burstiness,  # 1.0: Poisson arrivals, as vLLM's default
        "max_concurrency": None,
        "duration": duration_s,
        "completed": completed,
        "failed": failed,
        "total_output_tokens": round(out_tput * duration_s),
        "request_throughput": req_tput,
        "request_goodput": None,  # vLLM writes None without --goodput
        "output_throughput": out_tput,
    }
    total_in = point.get("total_input_tokens")  # the completed requests' prompts
    if total_in is not None:
        result["total_input_tokens"] = int(total_in)
        result["total_token_throughput"] = (total_in / duration_s if duration_s > 0 else 0.0) + out_tput
    for ours, theirs in _SAME_METRIC.items():
        if point.get(ours) is not None and math.isfinite(point[ours]):
            result[theirs] = point[ours]
    result.update({k: point[k] for k in _OPTIONAL if point.get(k) is not None})
    return result


def confirmed_metadata(d: Decision, v: TrialView) -> dict[str, Any]:
    """The numbers every view gives `v`, as metadata keys beside the replay's own: its throughput (confirmed: the
    median over the rounds, its interval and round count), its gain over vLLM's defaults, whether it is the
    recommendation, and where the baseline is not quite vLLM's defaults, what it ran with."""
    gain = d.gain(v)
    out: dict[str, Any] = {"optimizer_recommended": d.best is v,
                           "optimizer_output_throughput": d.throughput(v).to_dict(),
                           "optimizer_gain_over_defaults": gain.to_dict() if gain is not None else None}
    if v.baseline and d.defaults_as_run:
        out["optimizer_not_vllm_defaults"] = {k: {"value": x, "why": why} for k, (x, why) in d.defaults_as_run.items()}
    return out


def write_bench_json(path: Path, result: dict[str, Any]) -> Path:
    """Write one result object (one line of JSON, as vLLM does)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    return path


def study_of(study_name: str, trial: FrozenTrial) -> str:
    """The Optuna study that holds `trial`: the study, or for a confirmation run its confirmation study."""
    return confirmation_study_name(study_name) if is_confirmation(trial) else study_name
