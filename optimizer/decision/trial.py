"""One finished trial as the decision sees it: the trial and its curve ranked under the report's limit."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from optuna.trial import FrozenTrial

from optimizer.config.limits import Limits
from optimizer.measurement.rate_fit import RateAtLimit
from optimizer.measurement.rerank import Ranked, rank_curve
from optimizer.search.attrs import ENGINE_CONFIG, ENGINE_PARAMS
from optimizer.search.measured import TrialMeasurement, measurement_of
from optimizer.search.rejudge import Rejudged
from optimizer.search.study import is_baseline


@dataclass(frozen=True)
class TrialView:
    """One finished trial as seen under the report's limit."""

    trial: FrozenTrial
    ranked: Ranked
    rejudged: Rejudged | None = None  # its stored probes judged again at the report's other limits

    def fit_under(self, reranked: bool) -> RateAtLimit | None:
        """Its rate at the report's limits with the 95% interval: the fit of its probes judged again at them where
        they were re-judged, its own stored fit at the study's own limits, else none."""
        if self.rejudged is not None:
            return self.rejudged.fit
        return None if reranked or self.measured is None else self.measured.rate_at_limit

    @classmethod
    def under(cls, trial: FrozenTrial, limits: Limits) -> TrialView:
        """The trial with its stored probes ranked under `limits`."""
        m = measurement_of(trial)
        return cls(trial, rank_curve(() if m is None else m.curve, limits))

    @property
    def number(self) -> int:
        return self.trial.number

    @property
    def baseline(self) -> bool:
        return is_baseline(self.trial)

    @property
    def engine_config(self) -> dict[str, Any]:
        return dict(ENGINE_CONFIG.of(self.trial) or ENGINE_PARAMS.of(self.trial))

    @cached_property
    def measured(self) -> TrialMeasurement | None:
        """Its measurement (search/measured.py), read once; None where it stored none."""
        return measurement_of(self.trial)

    @property
    def curve(self) -> list[dict[str, Any]]:
        """Its probes: judged again at the report's limits where they were (`rejudged`), else as stored."""
        if self.rejudged is not None:
            return list(self.rejudged.curve)
        return [] if self.measured is None else list(self.measured.curve)
