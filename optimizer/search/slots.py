"""`--gpus`: a study's search trials run at once, one slot process per GPU of the pool, each trial on as many of
its GPUs as its layout needs (hardware/gpu_pool.py).

- **One process per slot.** A vLLM engine runs in the process that starts it and reads the process's environment
  (CUDA_VISIBLE_DEVICES): concurrent trials need processes of their own. Each slot is this same `optimize` command
  with `--slot`: it opens the study the run opened, runs search trials (`run_to_budget`) until the study holds its
  budget, and exits; it says nothing on the console, its lines go to the study's logs (slot-K.log).
- **The run watches.** This process prints each trial's line as the study stores it, and stops the slots together:
  Ctrl-C or SIGTERM reaches every slot, which shuts its engine down and ends its trial to be queued again; a slot
  that stops on an error (another program on its GPU, the database gone) stops the others, and its line is the run's.
- **One budget.** A slot starts a trial only while the study's finished and running trials are under the budget,
  and checks and creates it under one lock the slots share (`BudgetGate`): the slots together never run more.
- **Sampling knows what runs.** The sampler is TPE with constant liar (search/study.py): a slot's next config is
  drawn knowing the configs the other slots are running.
- **One SQLite file.** The slots carry the run's id (RUN_ENV), so that they share a SQLite study that refuses a
  second run (search/study.py `refuse_parallel_sqlite`).
- **The confirmation** runs after every slot has stopped, in this process, one run at a time on the pool: with no
  other trial running, each run gets the same GPUs (the lowest free group for its layout), so a round's pairs are
  measured on the same GPUs; each run records the GPUs it ran on.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from optimizer.core.errors import OptimizerError

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial

    from optimizer.search.budget import BudgetStop

SLOT_FLAG = "--slot"
STOP_WAIT_S = 120.0  # how long the slots get to shut their engines down after Ctrl-C or SIGTERM
POLL_S = 1.0


class BudgetGate:
    """An exclusive lock (`flock` on `path`) held from the budget check until the trial exists: processes that share
    `path` (a run's slots, search/slots.py) never both start the budget's last trial."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file releases its lock
            self._fd = None


def gate_path(logs_dir: Path) -> Path:
    return logs_dir / "budget.lock"


@dataclass
class Slot:
    number: int
    process: subprocess.Popen
    log_path: Path
    log: IO[bytes] = field(repr=False)

    def last_line(self) -> str:
        """The slot's last line that says something: its error, or how it stopped."""
        try:
            lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        errors = [ln for ln in lines if ln.startswith("error:")]
        return (errors or lines or [""])[-1]


def start_slots(argv: Sequence[str], count: int, logs_dir: Path, run_id: str | None = None) -> list[Slot]:
    """`count` slot processes of this command (`argv`, with SLOT_FLAG), their output in logs_dir/slot-K.log, all
    carrying one run id (RUN_ENV)."""
    from optimizer.search.recovery import RUN_ENV, SLOT_ENV

    logs_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, RUN_ENV: run_id or os.environ.get(RUN_ENV) or uuid.uuid4().hex}
    os.environ[RUN_ENV] = env[RUN_ENV]  # this process's confirmation runs are the same run's
    slots = []
    for k in range(count):
        log_path = logs_dir / f"slot-{k}.log"
        log = open(log_path, "ab")
        process = subprocess.Popen([sys.executable, "-m", "optimizer", *argv, SLOT_FLAG], stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=subprocess.STDOUT, env={**env, SLOT_ENV: str(k)})
        slots.append(Slot(k, process, log_path, log))
    return slots


def stop_slots(slots: Sequence[Slot], wait_s: float = STOP_WAIT_S) -> None:
    """SIGTERM to every slot still running (each shuts its engine down and ends its trial to be queued again), then
    SIGKILL past `wait_s`."""
    for s in slots:
        if s.process.poll() is None:
            s.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    for s in slots:
        try:
            s.process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            s.process.kill()
            s.process.wait()
    for s in slots:
        s.log.close()


def watch(study: optuna.Study, slots: Sequence[Slot], on_trial: Callable[[optuna.Study, FrozenTrial], None],
          poll_s: float = POLL_S, sleep: Callable[[float], None] = time.sleep) -> BudgetStop:
    """Say each search trial the slots finish (`on_trial`), in the order they finish, until every slot has exited;
    a slot that failed stops the others, and its line is raised (OptimizerError). Ctrl-C or SIGTERM stops them all,
    then goes on up."""
    from optimizer.search.budget import BudgetStop
    from optimizer.search.study import search_trials

    seen = {t.number for t in search_trials(study)}
    ran = 0
    try:
        while True:
            done = all(s.process.poll() is not None for s in slots)
            for t in sorted(search_trials(study), key=lambda t: (t.datetime_complete or 0, t.number)):
                if t.number not in seen:
                    seen.add(t.number)
                    ran += 1
                    on_trial(study, t)
            failed = [s for s in slots if s.process.poll() not in (None, 0)]
            if failed:
                stop_slots(slots)
                line = failed[0].last_line().removeprefix("error: ")
                raise OptimizerError(f"slot {failed[0].number} stopped: {line} (its log: {failed[0].log_path})")
            if done:
                break
            sleep(poll_s)
    except (KeyboardInterrupt, SystemExit):
        stop_slots(slots)
        raise
    for s in slots:
        s.log.close()
    return BudgetStop(ran)
