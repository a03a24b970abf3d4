"""What the console shows while a study runs: one line per search trial and per confirmation run, and one progress
display over both with one estimate of the time left.

On a terminal the display is a live bar below the lines, redrawn every second, so that the elapsed time ticks and the
estimate counts down while a trial runs. Anywhere else (a log file, CI) there are no redraws: the lines alone, and a
"still running" line after HEARTBEAT_S without any.

The estimate is the work not yet finished at each one's estimated length: search trials at the median of the study's
trials (the probe's estimate before any), confirmation runs at theirs (search/confirm.py `run_estimate_s`), capped by
a deadline. It is made at each trial's end from the study, then counted down on the clock alone (the display's thread
never reads the study).
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

import optuna
from optuna.trial import FrozenTrial, TrialState
from tqdm import tqdm

from optimizer.config.limits import key_name
from optimizer.core.units import format_ms
from optimizer.measurement.disturbance import disturbance_text, disturbed
from optimizer.search.attrs import (
    BASELINE, CONFIRM, LIMITED_BY, MACHINE_LOAD, PRUNED_DETAIL, PRUNED_REASON, STUDY_CONFIRMATION, TIMINGS,
)
from optimizer.search.measured import TrialMeasurement, measurement_of
from optimizer.search.missed import rate_text, why_infeasible
from optimizer.search.placement import gpus_text
from optimizer.search.score import feasible, rate_at_limit_text, scored_best_first
from optimizer.search.study import confirmation_runs, finished_count

TICK_S = 1.0  # a live display is redrawn this often
HEARTBEAT_S = 300.0  # not on a terminal: a "still running" line after this long without a line


def describe(trial: FrozenTrial) -> str:
    """One line: what the trial measured, or what stopped it, in rates (and its engine's limit on a second line)."""
    label = "baseline (vLLM defaults)" if BASELINE.of(trial) else "trial"
    if trial.state == TrialState.PRUNED:
        return (f"{label} #{trial.number}: cannot run: {PRUNED_REASON.of(trial) or '?'}: "
                f"{str(PRUNED_DETAIL.of(trial))[:160]}")
    m = measurement_of(trial)
    took = f"[{TIMINGS.of(trial).get('total_s', 0):.0f}s{gpus_text(trial)}]"
    if m is None:
        return f"{label} #{trial.number}: ended without a measurement ({trial.state.name}) {took}"
    if feasible(trial):
        line = (f"{label} #{trial.number}: {rate_at_limit_text(m)}; {m.output_throughput_tok_s:.1f} "
                f"tok/s, {values_text(m)} at {rate_text(m.rate_rps)} {took}")
    else:
        line = f"{label} #{trial.number}: {why_infeasible(m)} {took}"
    load = MACHINE_LOAD.of(trial)
    if disturbed(load):  # a search trial only ranks: it is said, not run again (the confirmation's runs are)
        line += f"; disturbed: {disturbance_text(load)}" + ("; no incumbent for the trials after it"
                                                            if feasible(trial) else "")
    limited = LIMITED_BY.of(trial)
    bound = m.bound_text
    if limited and bound and not feasible(trial):  # the line above names the limit it missed already
        limited = limited.replace(f"limited by {bound}; ", "limited by ", 1)
    if limited:
        return f"{line}\n  {limited}" if not bound or bound in limited or not feasible(trial) \
            else f"{line}\n  limited by {bound}; {limited}"
    return f"{line}\n  limited by {bound}" if bound and feasible(trial) else line


def values_text(m: TrialMeasurement) -> str:
    """'TTFT P99 80ms, TPOT P99 41ms': each limit's statistic at the trial's rate."""
    return ", ".join(f"{key_name(k)} {format_ms(v) if v is not None else 'n/a'}"
                     for k, v in m.values_at_rate_ms.items())


def best_text(study: optuna.Study) -> str:
    """'best #7: 1374.9 tok/s at 37.60 req/s': the search's best so far, its throughput at its own rate."""
    scored = scored_best_first(study)
    if not scored:
        return "best: none meets the limit yet"
    trial, ranked = scored[0]
    return f"best #{trial.number}: {ranked.output_throughput_tok_s:.1f} tok/s at {rate_text(ranked.rate_rps)}"


def work_s(trials_left: int | None, trial_s: float | None, runs_left: int, run_s: float | None) -> float | None:
    """Pure: how long the search trials and confirmation runs still to finish take at their estimated lengths; None
    when that is not known (no estimate yet, or the trials left are not counted: a deadline alone decides)."""
    if trials_left is None or (trials_left and trial_s is None) or (runs_left and run_s is None):
        return None
    return trials_left * (trial_s or 0.0) + runs_left * (run_s or 0.0)


def clock_text(seconds: float) -> str:
    """3725 -> '1h02m', 125 -> '2m05s', 42 -> '42s'."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


@dataclass(frozen=True)
class Status:
    """Where a run stands after its latest trial: what is done of how much, and the estimated time left then."""

    phase: str  # "search", "confirmation 2/9"
    done: int  # search trials and confirmation runs finished
    total: int | None  # ... of those planned (None: a deadline decides)
    at_s: float  # the clock reading the estimate was made at
    work_s: float | None = None  # the work not yet finished, at its estimated lengths (work_s())
    next_s: float = 0.0  # of which the trial or run starting now
    deadline_unix_s: float | None = None
    best: str = ""  # "best #7: 1374.9 tok/s"

    def left_s(self, now_s: float) -> float | None:
        """Pure: the time left at `now_s`: the work counted down since the estimate, never below the work not yet
        started (a trial that runs long holds it), capped by the deadline; None when nothing is known."""
        known = []
        if self.work_s is not None:
            known.append(max(self.work_s - (now_s - self.at_s), self.work_s - self.next_s, 0.0))
        if self.deadline_unix_s is not None:
            known.append(max(self.deadline_unix_s - now_s, 0.0))
        return min(known) if known else None

    def text(self, started_s: float, now_s: float) -> str:
        """Pure: '12/40 search, 8m12s elapsed, ~20m05s left, best #7: 1374.9 tok/s at 37.60 req/s'."""
        left = self.left_s(now_s)
        count = f"{self.done} done ({self.phase})" if self.total is None else f"{self.done}/{self.total} {self.phase}"
        if left is None:
            eta = "time left unknown"
        elif left < 1 and (self.total is None or self.done < self.total):
            eta = "finishing"  # the last trial or run takes longer than estimated
        else:
            eta = f"~{clock_text(left)} left"
        parts = [count, f"{clock_text(now_s - started_s)} elapsed", eta]
        return ", ".join(parts + ([self.best] if self.best else []))


def console_stream() -> TextIO:
    """The console as it is now: a copy of stderr's file descriptor, so that the display still reaches it while a
    trial points descriptor 2 at its engine's log (core/processes.py `output_to`); sys.stderr itself when it has no
    descriptor (a test's capture)."""
    try:
        return os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1, encoding="utf-8", errors="replace")
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return sys.stderr


class Progress:
    """The console of a run: `write` a line (a trial's, a run's, a note), `update` the status after each trial.

    Live (a terminal): a bar under the lines, redrawn every `tick_s` by a thread of its own. Otherwise: the lines as
    they are, and `still running: <status>` when `heartbeat_s` passed without a line. `now` and `thread=False` are
    for tests, which call `tick()` themselves."""

    def __init__(self, status: Status, stream: TextIO | None = None, live: bool | None = None,
                 now: Callable[[], float] = time.time, tick_s: float = TICK_S, heartbeat_s: float = HEARTBEAT_S,
                 thread: bool = True) -> None:
        self._own_stream = stream is None
        self._stream = console_stream() if stream is None else stream
        self._live = self._stream.isatty() if live is None else live
        self._now, self._heartbeat_s = now, heartbeat_s
        self._status, self._started_s = status, now()
        self._last_line_s = self._started_s
        self._lock = threading.Lock()
        self._bar = None
        if self._live:
            self._bar = tqdm(total=status.total, initial=status.done, file=self._stream, dynamic_ncols=True,
                             leave=True, mininterval=0, bar_format="{desc}")
            self._draw()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick_until_closed, args=(tick_s,), daemon=True) \
            if thread else None
        if self._thread is not None:
            self._thread.start()

    @property
    def live(self) -> bool:
        return self._live

    def text(self) -> str:
        """The status line as it reads now."""
        return self._status.text(self._started_s, self._now())

    def write(self, *parts: object) -> None:
        """A line of its own (a trial's, a note), above the live bar; print-like, for `say`."""
        line = " ".join(str(p) for p in parts)
        with self._lock:
            if self._bar is not None:
                self._bar.write(line, file=self._stream)
            else:
                self._stream.write(line + "\n")
                self._stream.flush()
            self._last_line_s = self._now()

    def update(self, status: Status) -> None:
        """A new status, made after a trial ended (the display counts it down between trials)."""
        self._status = status
        with self._lock:
            self._draw()

    def tick(self) -> None:
        """Redraw the live bar (the clock moved); not live, a `still running` line when none came for a while."""
        with self._lock:
            if self._bar is not None:
                self._draw()
                return
        if self._now() - self._last_line_s >= self._heartbeat_s:
            self.write(f"still running: {self.text()}")

    def close(self) -> None:
        """Stop the display, leaving the bar as it stands (a run stopped by Ctrl-C shows how far it got)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._bar is not None:
                self._draw()
                self._bar.close()
                self._bar = None
        if self._own_stream and self._stream is not sys.stderr:
            self._stream.close()

    def _draw(self) -> None:
        if self._bar is None:
            return
        s = self._status
        self._bar.total, self._bar.n = s.total, s.done
        self._bar.bar_format = "|{bar:20}| {desc}" if s.total else "{desc}"
        self._bar.set_description_str(self.text(), refresh=False)
        self._bar.refresh()

    def _tick_until_closed(self, tick_s: float) -> None:
        while not self._stop.wait(tick_s):
            self.tick()


class Ticker:
    """A step that runs before any trial and says nothing while it works (the demo's probe, the pilot, the
    pre-screen): on a terminal, one live line under its own, 'probe: measuring this machine, 23s elapsed', redrawn
    every `tick_s` and gone when the step ends (the step's next line says what it found). Anywhere else nothing: no
    redraws in a log. A context manager; the step's lines go through `write` (above the live line; elsewhere to
    `say`). `now` and `thread=False` are for tests, which call `tick()` themselves."""

    def __init__(self, what: str, say: Callable[..., None], stream: TextIO | None = None, live: bool | None = None,
                 now: Callable[[], float] = time.time, tick_s: float = TICK_S, thread: bool = True) -> None:
        self._what, self._say, self._now, self._tick_s, self._thread_wanted = what, say, now, tick_s, thread
        self._lock = threading.Lock()
        self._own_stream = stream is None
        self._stream = console_stream() if stream is None else stream
        self._live = self._stream.isatty() if live is None else live
        self._bar = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_s = now()

    def text(self) -> str:
        return f"{self._what}, {clock_text(self._now() - self._started_s)} elapsed"

    def write(self, *parts: object) -> None:
        """A line of the step's own (print-like, for `say`): above the live line, or as `say` prints it."""
        with self._lock:
            if self._bar is None:
                self._say(*parts)
            else:
                self._bar.write(" ".join(str(p) for p in parts), file=self._stream)

    def tick(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.set_description_str(self.text(), refresh=True)

    def __enter__(self) -> Ticker:
        self._started_s = self._now()
        if self._live:
            self._bar = tqdm(file=self._stream, dynamic_ncols=True, leave=False, mininterval=0, bar_format="{desc}")
            self.tick()
            if self._thread_wanted:
                self._thread = threading.Thread(target=self._tick_until_closed, daemon=True)
                self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        if self._own_stream and self._stream is not sys.stderr:
            self._stream.close()

    def _tick_until_closed(self) -> None:
        while not self._stop.wait(self._tick_s):
            self.tick()


@dataclass
class Tally:
    """What a run plans and has done, for its progress display: search trials out of the search's budget (None: a
    deadline decides), then confirmation runs out of those planned. The runs planned shrink to what the queued plan
    holds (fewer candidates than a round has room for) and, at the end, to what ran (a confirmation that stopped
    early)."""

    search_budget: int | None
    runs_planned: int
    runs_done: int = 0
    confirming: bool = False

    def resume(self, study: optuna.Study) -> None:
        """A study whose search is done may have run part of its confirmation: count its runs of the stored plan."""
        if self.search_budget is None or finished_count(study) < self.search_budget:
            return
        from optimizer.search.confirm import plan_key

        stored = STUDY_CONFIRMATION.of(study)
        if not stored or stored.get("plan") != plan_key(study):  # none, or a plan of a shorter search before
            return
        runs = [t for t in confirmation_runs(study, (TrialState.COMPLETE, TrialState.PRUNED))
                if (CONFIRM.of(t) or {}).get("plan") == stored.get("plan")]
        if runs:
            self.runs_done = len(runs)
            self.runs_planned = max(self.runs_planned, self.runs_done)

    def confirm(self, runs: int) -> None:
        """The search is over: `runs` are planned (the rounds that fit before a deadline)."""
        self.confirming, self.runs_planned = True, max(runs, self.runs_done)

    def run_done(self, study: optuna.Study) -> None:
        self.runs_done += 1
        stored = STUDY_CONFIRMATION.of(study) or {}
        if stored.get("candidates") and stored.get("rounds"):  # as queued: its rounds of its candidates
            from optimizer.search.confirmed import planned_runs

            planned = planned_runs(stored)  # a candidate clearly behind ran only the rounds before it dropped
            if stored.get("served"):  # the runs through `vllm serve` after the rounds
                from optimizer.search.split import SERVED_CONFIGS

                planned += SERVED_CONFIGS
            self.runs_planned = max(planned, self.runs_done)

    def confirmed(self) -> None:
        """The confirmation is over, perhaps early: the runs planned are the runs done."""
        self.runs_planned = self.runs_done

    def status(self, study: optuna.Study, trial_s: float | None, run_s: float | None,
               deadline_unix_s: float | None) -> Status:
        """Where the run stands now, with the time its work left takes at `trial_s` a trial and `run_s` a run."""
        import time

        finished = finished_count(study)
        trials_left = None if self.search_budget is None else max(self.search_budget - finished, 0)
        if self.confirming:
            trials_left = 0
        runs_left = max(self.runs_planned - self.runs_done, 0)
        total = None if self.search_budget is None and not self.confirming else \
            finished + (trials_left or 0) + self.runs_done + runs_left
        phase = f"confirmation {self.runs_done}/{self.runs_planned}" if self.confirming and self.runs_planned \
            else "search"
        return Status(phase=phase, done=finished + self.runs_done, total=total, at_s=time.time(),
                      work_s=work_s(trials_left, trial_s, runs_left, run_s),
                      next_s=(trial_s if trials_left else run_s if runs_left else 0.0) or 0.0,
                      deadline_unix_s=deadline_unix_s, best="" if self.confirming else best_text(study))
