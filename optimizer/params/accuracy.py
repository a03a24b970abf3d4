"""Pure: which searched engine arguments change what the model computes, not only how fast it serves. A study drives
the engine with token ids and measures speed: it never sees an answer, so a recommendation that carries one of these
says to check the model's outputs before it is deployed (vLLM itself warns of an accuracy drop for an fp8 KV cache
without calibrated scales, and of a crash or incorrect outputs with chunked prefill turned off)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from optimizer.params.parallel import ONLINE_WEIGHT_SHARE

# vLLM 0.32's quantizations made on the fly from a 16-bit checkpoint (params/parallel.py's table of them), but mxfp4,
# which names gpt-oss's own checkpoint format; any other `quantization` it accepts must name the checkpoint's own format
# or a kernel of it (vllm/config/model.py refuses the rest), which stores the same weights: no change in what the
# model computes.
ONLINE_QUANTIZATION = frozenset(ONLINE_WEIGHT_SHARE) - {"mxfp4"}
# a KV cache kept at 16 bits or more: the model's own numbers
SAME_AS_MODEL = frozenset({None, "auto", "bfloat16", "float16", "half", "float", "float32"})


def accuracy_line(searched: Mapping[str, Any]) -> str | None:
    """The export's line for the searched values (a trial's sampled params) that change the model's numbers, or None.
    Values the user fixed for every trial are theirs, not the search's: pass only what was searched."""
    changed = {}
    if searched.get("kv_cache_dtype") not in SAME_AS_MODEL:
        changed["kv_cache_dtype"] = searched["kv_cache_dtype"]
    if searched.get("quantization") in ONLINE_QUANTIZATION:
        changed["quantization"] = searched["quantization"]
    # vLLM 0.32 (engine/arg_utils.py) warns when it is turned off for a model that supports it: "may cause the engine
    # to crash or produce incorrect outputs"
    unsupported = searched.get("enable_chunked_prefill") is False
    if not changed and not unsupported:
        return None
    what = []
    if changed:
        what.append(", ".join(f"{k}={v}" for k, v in changed.items()) + " changes what the model computes, not only "
                    "its speed")
    if unsupported:
        what.append("enable_chunked_prefill=False is not officially supported by vLLM for a model that supports "
                    "chunked prefill (it warns that the engine may crash or produce incorrect outputs)")
    return ("Not checked: " + "; ".join(what) + ". This study measured speed alone (token ids, no answers): check "
            "the model's accuracy with it on your own task before deploying, or search without it.")
