"""A progress bar over trials that shows the best feasible throughput so far, and one line per trial."""

from __future__ import annotations

import math
import sys

import optuna
from optuna.trial import FrozenTrial, TrialState
from tqdm import tqdm

from optimizer.report import feasible, recommended
from optimizer.study import finished_count
from optimizer.units import format_ms


def describe(trial: FrozenTrial) -> str:
    """One line: what the trial measured or why it could not run."""
    label = "baseline (vLLM defaults)" if trial.user_attrs.get("baseline") else "trial"
    if trial.state == TrialState.PRUNED:
        return (f"{label} #{trial.number}: cannot run: {trial.user_attrs.get('pruned_reason', '?')}: "
                f"{str(trial.user_attrs.get('pruned_detail', ''))[:160]}")
    r = trial.user_attrs.get("result", {})
    rate = r.get("rate_rps")
    where = "a burst" if rate is None else f"{rate:.2f} req/s"
    verdict = "meets the limit" if feasible(trial) else (
        "cannot beat the best so far: stopped early" if r.get("stopped_early") else "misses the limit at every rate")
    t = trial.user_attrs.get("timings", {})
    ttft = r.get("ttft_p99_ms", math.nan)
    line = (f"{label} #{trial.number}: {r.get('output_throughput_tok_s', 0):.1f} tok/s at {where}, "
            f"TTFT P99 {format_ms(ttft)} ({verdict}) [{t.get('total_s', 0):.0f}s]")
    limited = trial.user_attrs.get("limited_by")
    return f"{line}\n  {limited}" if limited else line


class Progress:
    """Callback for `study.optimize`."""

    def __init__(self, study: optuna.Study, budget: int, quiet: bool = False) -> None:
        self._quiet = quiet
        self._bar = None if quiet else tqdm(total=budget, initial=min(finished_count(study), budget),
                                            desc="trials", unit="trial", file=sys.stderr, dynamic_ncols=True)
        self._update(study)

    def _update(self, study: optuna.Study) -> None:
        if self._bar is None:
            return
        best = recommended(study)
        self._bar.set_postfix_str("best: none feasible yet" if best is None else
                                  f"best: {best.values[0]:.1f} tok/s (#{best.number})")

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if self._bar is None:
            return
        self._bar.write(describe(trial), file=sys.stderr)
        if trial.state in (TrialState.COMPLETE, TrialState.PRUNED):
            self._bar.update(1)
        self._update(study)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
