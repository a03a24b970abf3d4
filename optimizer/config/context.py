"""Pure: the context lengths vLLM 0.32 derives from a model's `config.json` (`ModelConfig.get_and_verify_max_len`).

Two numbers: the longest `max_model_len` a config may ask for, and the one vLLM takes where a config leaves it out,
which is what vLLM's own defaults (the baseline) run with and what the memory check must hold one sequence of:

- the smallest of the length keys the text config has (`derive_max_model_len_and_key`: `max_position_embeddings`,
  `n_positions`, `max_seq_len`, `seq_length`, `model_max_length`, `max_target_positions`, `max_sequence_length`,
  `max_seq_length`, `seq_len`), `model_max_length` in place of them all where set (Command R); 2048 with none;
- times the RoPE scaling factor of the types that do not scale `max_position_embeddings` themselves (`linear`,
  `dynamic`: not `longrope`/`su`, `llama3`, the YaRN kinds, nor any Gemma 3);
- where left out, a LongRoPE model (Phi-3-mini-128k, Phi-3.5/4-mini) takes its `original_max_position_embeddings`
  (4096 for Phi-3-mini), not the 131072 it may ask for: one sequence of it is 32 times smaller.
"""

from __future__ import annotations

from typing import Any

LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
            "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# RoPE types whose max_position_embeddings is already the scaled length (vLLM's _get_and_verify_max_len)
SCALED_ALREADY = frozenset({"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"})
NO_LENGTH_DEFAULT = 2048


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def rope_parameters(text_config: dict) -> list[dict]:
    """The RoPE parameters of a config as read from disk (transformers 5's `rope_parameters`, or the older
    `rope_scaling`), one dict per layer type where nested; `type` read as `rope_type`, `su` as `longrope`."""
    given = text_config.get("rope_parameters") or text_config.get("rope_scaling")
    if not isinstance(given, dict) or not given:
        return []
    nested = [v for v in given.values() if isinstance(v, dict)]
    out = []
    for p in nested if nested and len(nested) == len(given) else [given]:
        kind = str(p.get("rope_type") or p.get("type") or "default")
        out.append({**p, "rope_type": "longrope" if kind == "su" else kind})
    return out


def context_lengths(text_config: dict) -> tuple[int, int]:
    """(the longest max_model_len vLLM takes for this model, the one it takes where a config leaves it out)."""
    found = [text_config[k] for k in LEN_KEYS if _number(text_config.get(k))]
    derived = float(min(found)) if found else float(NO_LENGTH_DEFAULT)
    if _number(text_config.get("model_max_length")):
        derived = float(text_config["model_max_length"])
    ropes = rope_parameters(text_config)
    if ropes and "gemma3" not in str(text_config.get("model_type", "")):
        factor = 1.0
        for p in ropes:
            if p["rope_type"] not in SCALED_ALREADY:
                factor = p.get("factor", factor)
        derived *= factor if _number(factor) else 1.0
    longest = int(derived)
    original = text_config.get("original_max_position_embeddings")
    if any(p["rope_type"] == "longrope" for p in ropes) and _number(original):
        return longest, int(original)
    return longest, longest
