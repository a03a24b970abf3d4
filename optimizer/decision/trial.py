"""One finished trial as the decision sees it: the trial and its curve ranked under the report's limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from optuna.trial import FrozenTrial

from optimizer.measurement.rerank import Ranked
from optimizer.search.attrs import CURVE, ENGINE_CONFIG, ENGINE_PARAMS
from optimizer.search.study import is_baseline


@dataclass(frozen=True)
class TrialView:
    """One finished trial as seen under the report's limit."""

    trial: FrozenTrial
    ranked: Ranked

    @property
    def number(self) -> int:
        return self.trial.number

    @property
    def baseline(self) -> bool:
        return is_baseline(self.trial)

    @property
    def engine_config(self) -> dict[str, Any]:
        return dict(ENGINE_CONFIG.of(self.trial) or ENGINE_PARAMS.of(self.trial))

    @property
    def curve(self) -> list[dict[str, Any]]:
        return list(CURVE.of(self.trial))
