"""How long one engine step takes: the simulator's time model, fitted to a real engine by `optimize calibrate`.

One step of vLLM's continuous batching runs the forward pass over every scheduled token at once. Its time is
modelled as linear in what the step holds (as Vidur and vLLM's own cost models do, in simpler form):

    step_s = fixed_s + prefill_token_s * prefill tokens + decode_seq_s * decode sequences
             + context_token_s * tokens already in the KV cache of the scheduled sequences
             + prefill_attention_s * sum over prefill chunks of n * (cached + n / 2)   (attention is quadratic)
             + request_s * requests whose prefill starts in this step (admission, input preparation)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from optimizer.core.errors import UsageError


@dataclass(frozen=True)
class StepTimeModel:
    fixed_s: float = 0.004
    prefill_token_s: float = 2.0e-5
    decode_seq_s: float = 3.0e-4
    context_token_s: float = 1.0e-7
    prefill_attention_s: float = 0.0
    request_s: float = 0.0
    engine_start_s: float = 17.0  # what one trial pays before its first replay (for simulated minutes)
    engine_shutdown_s: float = 4.7

    def step_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int, prefill_attention: float = 0.0,
               new_requests: int = 0) -> float:
        return (self.fixed_s + self.prefill_token_s * prefill_tokens + self.decode_seq_s * decode_seqs
                + self.context_token_s * context_tokens + self.prefill_attention_s * prefill_attention
                + self.request_s * new_requests)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"step_time_model": self.to_dict()}, indent=2) + "\n")

    @classmethod
    def load_or_nominal(cls, path: str | Path | None) -> StepTimeModel:
        """The calibration at `path` (`load`), or the nominal model where there is none."""
        return cls() if path is None else cls.load(path)

    @classmethod
    def load(cls, path: str | Path) -> StepTimeModel:
        """Read a calibration file written by `optimize calibrate`, or fail naming the fix."""
        p = Path(path)
        if p.exists():
            from optimizer.core.paths import require_file

            require_file(p, "calibration")
        else:
            raise UsageError(f"calibration file {str(p)!r} does not exist: write one with `optimize calibrate` first")
        try:
            data = json.loads(p.read_text())["step_time_model"]
            return cls(**{k: float(v) for k, v in data.items()})
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"calibration file {str(p)!r} is not one `optimize calibrate` wrote ({exc}): "
                             "run `optimize calibrate` again") from None


# What a step on several GPUs pays on top of its ranks' share of the work: the fixed term grows by this fraction per
# extra tensor-parallel rank (the all-reduces of every layer, whose latency does not shrink with the work).
TP_SYNC_FRACTION = 0.15


def for_tensor_parallel(model: StepTimeModel, tp: int) -> StepTimeModel:
    """Pure: a step of `model` on `tp` tensor-parallel GPUs: every token, sequence and context term split over the
    ranks (each computes its share of every layer), the fixed term grown by TP_SYNC_FRACTION per extra rank."""
    if tp <= 1:
        return model
    share = 1.0 / tp
    return replace(model, fixed_s=model.fixed_s * (1 + TP_SYNC_FRACTION * (tp - 1)),
                   prefill_token_s=model.prefill_token_s * share, decode_seq_s=model.decode_seq_s * share,
                   context_token_s=model.context_token_s * share,
                   prefill_attention_s=model.prefill_attention_s * share, request_s=model.request_s)


def calibration_machine(path: str | Path) -> dict[str, Any] | None:
    """The machine fingerprint a calibration file was made on (optimizer/hardware/machine.py); None in older files."""
    try:
        machine = json.loads(Path(path).read_text()).get("machine")
    except (OSError, ValueError, AttributeError):
        return None
    return machine if isinstance(machine, dict) else None
