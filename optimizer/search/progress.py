"""A progress bar over trials that shows the best feasible throughput so far, and one line per trial."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

import optuna
from optuna.trial import FrozenTrial, TrialState
from tqdm import tqdm

from optimizer.core.units import format_ms
from optimizer.search.attrs import BASELINE, LIMITED_BY, PRUNED_DETAIL, PRUNED_REASON, RESULT, TIMINGS
from optimizer.search.score import feasible, rate_at_limit_text, scored_best_first
from optimizer.search.study import finished_count, is_confirmation


def describe(trial: FrozenTrial) -> str:
    """One line: what the trial measured or why it could not run."""
    label = "baseline (vLLM defaults)" if BASELINE.of(trial) else "trial"
    if trial.state == TrialState.PRUNED:
        return (f"{label} #{trial.number}: cannot run: {PRUNED_REASON.of(trial) or '?'}: "
                f"{str(PRUNED_DETAIL.of(trial))[:160]}")
    r = RESULT.of(trial)
    t = TIMINGS.of(trial)
    took = f"[{t.get('total_s', 0):.0f}s]"
    if feasible(trial):
        line = (f"{label} #{trial.number}: {rate_at_limit_text(r)}; {r.get('output_throughput_tok_s', 0):.1f} "
                f"tok/s, TTFT P99 {format_ms(r.get('ttft_p99_ms', math.nan))} at {r.get('rate_rps') or 0:.2f} req/s "
                f"{took}")
    else:
        line = f"{label} #{trial.number}: {why_infeasible(r)} {took}"
    limited = LIMITED_BY.of(trial)
    return f"{line}\n  {limited}" if limited else line


def why_infeasible(result: dict) -> str:
    """In words and in rates, what stopped a trial that met the limit at no rate."""
    tried = result.get("requests")
    evidence = f" ({tried} requests)" if tried else ""
    floor = result.get("floor_rps")
    if result.get("stopped_early") and floor:
        return (f"missed the limit down to {floor:.2f} req/s, 0.9 x the best's lower bound: it cannot beat the best, "
                f"stopped early{evidence}")
    if result.get("stopped_early"):
        return f"cannot beat the best so far: stopped early{evidence}"
    return f"missed the limit at every rate tried, TTFT P99 {format_ms(result.get('ttft_p99_ms', math.nan))} at " \
           f"the closest{evidence}"


def remaining_s(budget: int | None, finished: int, trial_s: float | None, deadline_unix_s: float | None,
                now_unix_s: float) -> float | None:
    """Pure: the estimated time left: trials left x a trial's estimated duration, capped by the deadline."""
    by_trials = None if budget is None or trial_s is None else max(budget - finished, 0) * trial_s
    by_deadline = None if deadline_unix_s is None else max(deadline_unix_s - now_unix_s, 0.0)
    known = [x for x in (by_trials, by_deadline) if x is not None]
    return min(known) if known else None


def clock_text(seconds: float) -> str:
    """3725 -> '1h02m', 125 -> '2m05s', 42 -> '42s'."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class Progress:
    """Callback for `study.optimize`: a bar over trials with elapsed and estimated remaining time and the best
    result so far, and one line per trial."""

    def __init__(self, study: optuna.Study, budget: int | None, quiet: bool = False,
                 deadline_unix_s: float | None = None,
                 trial_estimate_s: Callable[[], float | None] = lambda: None,
                 now_unix_s: Callable[[], float] = time.time,
                 reserve_s: Callable[[], float] = lambda: 0.0) -> None:
        self._quiet = quiet
        self._reserve = reserve_s  # the confirmation's estimated time after the search
        self._budget, self._deadline, self._estimate, self._now = budget, deadline_unix_s, trial_estimate_s, now_unix_s
        self._started = now_unix_s()
        self._bar = None if quiet else tqdm(total=budget, initial=min(finished_count(study), budget or 10**9),
                                            desc="trials", unit="trial", file=sys.stderr, dynamic_ncols=True,
                                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}{postfix}"
                                            if budget is not None else "{desc}: {n_fmt}{postfix}")
        self._update(study)

    def postfix(self, study: optuna.Study) -> str:
        """'elapsed 3m12s, ~25m00s left, best: 731.0 tok/s (#19)'."""
        now = self._now()
        left = remaining_s(self._budget, finished_count(study), self._estimate(), self._deadline, now)
        if left is not None and self._deadline is None:
            left += self._reserve()
        scored = scored_best_first(study)
        best = scored[0] if scored else None
        parts = [f"elapsed {clock_text(now - self._started)}",
                 "time left unknown" if left is None else f"~{clock_text(left)} left",
                 "best: none feasible yet" if best is None else
                 f"best: {best[1].output_throughput_tok_s:.1f} tok/s (#{best[0].number})"]
        return ", ".join(parts)

    def _update(self, study: optuna.Study) -> None:
        if self._bar is None:
            return
        self._bar.set_postfix_str(self.postfix(study))

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if self._bar is None:
            return
        if is_confirmation(trial):
            from optimizer.search.confirm import describe as describe_run

            self._bar.write(describe_run(trial), file=sys.stderr)
            return
        self._bar.write(describe(trial), file=sys.stderr)
        if trial.state in (TrialState.COMPLETE, TrialState.PRUNED):
            self._bar.update(1)
        self._update(study)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
