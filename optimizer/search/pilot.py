"""`--num-requests auto`: a pilot trial chooses how many requests every replay of the study measures.

A replay's TTFT P99 is only as good as its count: over ~100 requests it is the slowest one. How many requests
a stable P99 needs depends on the latency tail (model, hardware, workload), so the tool measures the tail
instead of asking: before the study is created, vLLM's defaults run one trial (study NAME.pilot, in the same
storage) at `PILOT_REQUESTS` per replay. Its replays at its best rate (the limit's edge, where the P99 decides
pass or fail; the baseline replays there three times) give `stability.requests_needed`: the fewest requests whose
95% interval of the P99 is within `TOLERANCE` of it, counted in independent draws. In a queue, neighbouring
requests' TTFTs are correlated; each pilot replay, in send order, measures by how much
(`stability.effective_fraction`). The study is created with that count, the same for every
trial so that they compare, and it is stored with the study: resuming never runs the pilot again.

Bounds: never below `min_requests_for_upper_bound` (368: fewer cannot bound the P99 from above at all), never
above `MAX_AUTO_REQUESTS`, the requests the pilot's rate sends in `MAX_REPLAY_S` (a slow model must not take an
hour per replay), or the trace's length.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import optuna
from optuna.trial import TrialState

from optimizer.config.settings import StudyConfig
from optimizer.measurement.metrics import RequestRecord, measured_window, summarize
from optimizer.measurement.stability import effective_fraction, min_requests_for_upper_bound, requests_needed
from optimizer.measurement.workload import build_workload
from optimizer.search.measured import measurement_of
from optimizer.search.objective import Objective
from optimizer.search.records import RecordStore

PILOT_SUFFIX = ".pilot"
PILOT_REQUESTS = 200  # per pilot replay, at least: 20 in the top decile for the tail fit
TOLERANCE = 0.4  # the P99's 95% interval within 40% of it (the end-of-study advice uses the same)
MAX_AUTO_REQUESTS = 3000
MAX_REPLAY_S = 300.0  # a replay longer than this at the pilot's rate is capped (a slow model): minutes per trial


@dataclass(frozen=True)
class RequestsChoice:
    """The count a study replays, and why."""

    num_requests: int
    reason: str
    pilot_requests: int = 0  # per pilot replay
    pilot_samples: int = 0  # TTFTs the choice rests on (the pilot's replays at one rate, pooled)
    pilot_rate_rps: float | None = None  # where they were measured (None: a burst)
    pilot_p99_ms: float | None = None
    needed: int | None = None  # what the tail asked for, before the bounds
    effective_fraction: float = 1.0  # of the pilot's TTFTs, the share that counts as independent

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def replay_s(self) -> float | None:
        """About how long one replay takes at the pilot's rate."""
        if self.pilot_rate_rps is None or not self.pilot_rate_rps > 0:
            return None
        return self.num_requests / self.pilot_rate_rps


def choose_count(ttft_ms: Sequence[float], tolerance: float = TOLERANCE, cap: int = MAX_AUTO_REQUESTS,
                 limit: int | None = None, rate_rps: float | None = None,
                 max_replay_s: float = MAX_REPLAY_S, fraction: float = 1.0) -> tuple[int, int | None, str]:
    """Pure: (requests per replay, what the tail asked for, why) from TTFT samples (ms) at one rate, of which
    `fraction` count as independent (`stability.effective_fraction`).

    Bounds: at least the fewest requests that bound the P99 from above; at most `cap`, the requests `rate_rps`
    sends in `max_replay_s` (but not below that floor), and `limit`, a ceiling the workload sets (a trace's
    length)."""
    floor = min_requests_for_upper_bound()
    needed = requests_needed(ttft_ms, tolerance, fraction=fraction) if len(ttft_ms) >= 20 else None
    top, what = cap, f"{cap}, the most the pilot chooses"
    if rate_rps is not None and math.isfinite(rate_rps) and rate_rps > 0 and rate_rps * max_replay_s < top:
        top = max(floor, int(rate_rps * max_replay_s))
        what = f"{max_replay_s:.0f} s of requests at {rate_rps:.2f} req/s"
    if limit is not None and limit < top:
        top, what = limit, "the trace's length"
    if needed is None:
        n, why = floor, (f"the pilot's TTFTs show no tail to fit: {floor}, the fewest requests whose P99 has an "
                         f"upper 95% bound")
    elif needed > top:
        n, why = top, (f"the TTFT tail asks for {needed} requests to pin the P99 within {tolerance:.0%}; capped "
                       f"at {what}: the P99 stays less certain than that")
    else:
        n, why = needed, f"the fewest requests whose TTFT P99 is pinned within {tolerance:.0%} (95% interval)"
    if needed is not None and fraction < 1.0:
        why += (f"; neighbouring requests' TTFTs are correlated (queueing), so {fraction:.0%} of them count as "
                f"independent")
    if limit is not None and n > limit:
        n, why = limit, why + f"; the trace has only {limit} requests"
    return n, needed, why


def _at_rate(replays: list[tuple[float, list[RequestRecord]]], rate_rps: float | None,
             skip_first: float, skip_last: float) -> tuple[list[list[float]], float | None]:
    """TTFTs (ms, in send order) of each replay at `rate_rps` (None: at the rate of the lowest P99)."""
    if not replays:
        return [], None
    if rate_rps is None:
        finite = [(summarize(recs, rate, skip_first, skip_last).ttft.p99_ms, i) for i, (rate, recs)
                  in enumerate(replays)]
        finite = [(p, i) for p, i in finite if math.isfinite(p)]
        if not finite:
            return [], None
        rate_rps = replays[min(finite)[1]][0]
    chosen = [recs for rate, recs in replays if math.isclose(rate, rate_rps)]  # isclose(inf, inf) holds
    return [[1000 * r.ttft_s for r in sorted(measured_window(recs, skip_first, skip_last), key=lambda r: r.sent_s)
             if r.ok and r.ttft_s is not None] for recs in chosen], rate_rps


def run_pilot(config: StudyConfig, storage: optuna.storages.BaseStorage, objective: Objective,
              store: RecordStore, say: Callable[..., None] = lambda *a: None) -> tuple[StudyConfig, RequestsChoice]:
    """Measure vLLM's defaults in study NAME.pilot and return `config` with the chosen `num_requests`.

    `objective` is the study's own (engine, space, logs); the pilot runs it on a copy of the workload with
    `PILOT_REQUESTS` per replay and no early stop. A pilot already finished (a run stopped right after it) is
    reused, not run again.
    """
    from optimizer.search.budget import run_to_budget
    from optimizer.search.study import open_study

    spec = config.workload
    trace_len = len(spec.trace) if spec.trace else None
    pilot_n = max(spec.num_requests, PILOT_REQUESTS)
    if trace_len is not None:
        pilot_n = min(pilot_n, trace_len)
    pilot_spec = spec.model_copy(update={"num_requests": pilot_n})
    pilot_config = config.model_copy(update={"study_name": config.study_name + PILOT_SUFFIX, "budget": 1,
                                             "prescreen": 0, "repeats": 1, "workload": pilot_spec})
    pilot_study = open_study(pilot_config, storage)
    done = _finished_baseline(pilot_study)
    if not done:
        say(f"pilot: vLLM's defaults at {pilot_n} requests per replay (study {pilot_config.study_name!r}), to "
            f"measure the TTFT tail and choose how many requests each replay needs")
        assert objective.model is not None
        pilot = replace(objective, config=pilot_config, early_stop=False,
                        logs_dir=objective.logs_dir.with_name(pilot_config.study_name + ".logs"),
                        workload=build_workload(pilot_spec, objective.model.vocab_size))
        run_to_budget(pilot_study, pilot, 1)
        done = _wait_for_pilot(pilot_study, config.trial_timeout_s, say)
    choice = _choice(done[-1] if done else None, pilot_config, store, pilot_n, trace_len)
    final = config.model_copy(update={"workload": spec.model_copy(update={"num_requests": choice.num_requests})})
    say(choice_line(choice))
    return final, choice


def _finished_baseline(pilot_study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The pilot's measurement: vLLM's defaults, complete (a worker that raced another one into the pilot study
    may have added a sampled trial beside it: never the evidence)."""
    from optimizer.search.study import is_baseline

    return [t for t in pilot_study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE and is_baseline(t)]


def _wait_for_pilot(pilot_study: optuna.Study, timeout_s: float, say: Callable[..., None],
                    now: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                    poll_s: float = 5.0) -> list[optuna.trial.FrozenTrial]:
    """The finished pilot trial. When another worker started the same study a moment before, its pilot is the
    one running: wait for it (at most one trial's time limit), so that every worker takes the same count."""
    from optimizer.search.budget import wait_while_running

    wait_while_running(pilot_study, timeout_s, poll_s, now, sleep,
                       on_wait=lambda: say("pilot: another worker is running it; waiting for its result"))
    return _finished_baseline(pilot_study)


def _choice(trial: optuna.trial.FrozenTrial | None, pilot_config: StudyConfig, store: RecordStore, pilot_n: int,
            trace_len: int | None) -> RequestsChoice:
    if trial is None:
        n, _, why = choose_count([], limit=trace_len)
        return RequestsChoice(n, "the pilot could not measure vLLM's defaults; " + why, pilot_n)
    m = measurement_of(trial)
    met = m is not None and m.feasible
    rate = m.rate_rps if met else None
    replays = store.load(pilot_config.study_name, trial.number)
    spec = pilot_config.workload
    if met:
        series, at = _at_rate(replays, math.inf if rate is None else float(rate), spec.skip_first_fraction,
                              spec.skip_last_fraction)
    else:  # no rate met the limit: the closest miss still shows the tail's shape
        series, at = _at_rate(replays, None, spec.skip_first_fraction, spec.skip_last_fraction)
    ttft = [v for one in series for v in one]  # pooled for the tail's shape
    fractions = [effective_fraction(one) for one in series if len(one) >= 20]
    fraction = statistics.mean(fractions) if fractions else 1.0  # each replay's own order for the correlation
    n, needed, why = choose_count(ttft, limit=trace_len, rate_rps=at, fraction=fraction)
    p99 = float(np.percentile(ttft, 99)) if ttft else None  # linear interpolation, as the metrics use
    return RequestsChoice(n, why, pilot_n, len(ttft), at if at is not None and math.isfinite(at) else None,
                          round(p99, 1) if p99 is not None else None, needed, round(fraction, 3))


def choice_line(choice: RequestsChoice) -> str:
    where = "" if choice.pilot_p99_ms is None else (
        f"TTFT P99 {choice.pilot_p99_ms:.0f} ms over {choice.pilot_samples} pilot requests"
        + (f" at {choice.pilot_rate_rps:.2f} req/s" if choice.pilot_rate_rps else " in a burst") + "; ")
    duration = choice.replay_s()
    pace = f" (~{duration:.0f} s per replay at that rate)" if duration else ""
    return f"requests per replay: {choice.num_requests}{pace}: {where}{choice.reason}"
