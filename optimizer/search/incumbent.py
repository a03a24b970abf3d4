"""The incumbent a trial's early stop compares with: the lower bound of the best rate so far, never its luckiest
measurement.

A trial's rate search stops descending below 0.9 x the incumbent's rate (measurement/rate_search.py): a config
that meets the limit only there cannot win. Compared with the highest rate any trial happened to pass, one lucky
measurement of the incumbent would starve the study: every later trial would stop at 0.9 x a rate the incumbent
itself does not reach again. So the incumbent's rate is

- for a config the confirmation measured (search/confirm.py), the lower end of its rounds' 95% interval of rates;
- for a trial measured by probes sized by evidence, the lower end of its own rate interval (its pooled fit:
  measurement/rate_fit.py), never above the highest rate it passed;
- for a trial measured by fixed-length replays, its rate less a one-sided 95% margin of one measurement:
  (1 - 1.645 x SINGLE_RUN_RATE_CV). Several replays at its rate (`--repeats`) narrow it by their square root.

Where the study's trials run on different numbers of GPUs (tensor x pipeline x data parallel), the bounds compare
per GPU, as the ranking does (search/score.py): a 1-GPU trial that serves a third of a 4-GPU incumbent's rate beats
it per GPU, and must not be stopped at 0.9 x the 4-GPU rate.

A search trial that other processes disturbed (measurement/disturbance.py) is no incumbent: it still ranks, but its
number is the machine's as much as the config's, and one that came out high would stop every later trial at 0.9 x
it. (In a real study on the Xeon, trial #1 ran while others took 0.27 of a core and put its config at 133 req/s,
which its confirmation rounds measured at 99-107; the twelve trials after it all failed at 123 and 111 req/s, its
bound and 0.9 of it, and stopped.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import optuna
from optuna.trial import TrialState

from optimizer.measurement.disturbance import disturbed
from optimizer.measurement.intervals import interval
from optimizer.params.parallel import gpus_needed
from optimizer.search.attrs import CONFIRM, ENGINE_PARAMS, MACHINE_LOAD
from optimizer.search.measured import measurement_of
from optimizer.search.study import confirmation_runs, search_trials

# The spread of one trial's rate at the limit, measured once (the rung its bisection lands on, the P99 of one
# replay): 6% (docs/measurement.md#confirmation). One-sided 95%: 1.645 of it.
SINGLE_RUN_RATE_CV = 0.06
Z_ONE_SIDED_95 = 1.645


def single_run_lower_rps(rate_rps: float, replays: int = 1) -> float:
    """Pure: the lower bound of a rate passed by a trial whose best rate was replayed `replays` times."""
    return rate_rps * (1 - Z_ONE_SIDED_95 * SINGLE_RUN_RATE_CV / math.sqrt(max(replays, 1)))


def fair_incumbent_rate(study: optuna.Study, gpus: int = 1,
                        engine_args: Mapping[str, Any] | None = None) -> float | None:
    """The highest lower bound of a feasible rate among the study's finished trials (None before the first), search
    trials that others disturbed left out. Where trials run on different numbers of GPUs (their layouts, over
    `engine_args`), bounds compare per GPU, as the ranking does: the best bound per GPU, times `gpus`, the GPUs of the
    trial that asks."""
    args = dict(engine_args or {})
    complete = (TrialState.COMPLETE,)
    confirmed: dict[int, list[float]] = {}
    confirmed_gpus: dict[int, int] = {}
    for t in confirmation_runs(study, complete):
        c = CONFIRM.of(t) or {}
        m = measurement_of(t)
        if not c.get("served") and m is not None and m.feasible:  # a run as served measured another engine, slower
            confirmed.setdefault(int(c["of"]), []).append(math.inf if m.rate_rps is None else m.rate_rps)
            confirmed_gpus[int(c["of"])] = gpus_needed({**args, **(c.get("params") or {})})
    per_gpu = []  # (bound, its trial's GPUs)
    for number, rates in confirmed.items():
        iv = interval(rates)
        if iv.known and math.isfinite(iv.low):
            per_gpu.append((iv.low, confirmed_gpus[number]))
    for t in search_trials(study, complete):
        m = measurement_of(t)
        if m is None or not m.feasible or t.number in confirmed or disturbed(MACHINE_LOAD.of(t)):
            continue
        own = gpus_needed({**args, **ENGINE_PARAMS.of(t)})
        rate = m.rate_rps
        if rate is None:
            per_gpu.append((math.inf, own))
            continue
        fitted = m.rate_interval_rps
        if fitted is not None:  # its own interval, from every request it sent
            per_gpu.append((min(fitted[0], float(rate)), own))
            continue
        per_gpu.append((single_run_lower_rps(float(rate), m.replays_at(rate)), own))
    if not per_gpu:
        return None
    if len({g for _, g in per_gpu} | {gpus}) == 1:  # one layout size: rates as measured
        return max(b for b, _ in per_gpu)
    return max(b / g for b, g in per_gpu) * gpus
