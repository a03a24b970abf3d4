"""Re-rank a finished trial for other latency limits from the requests it stored, without rerunning it.

Every replay stores its requests (search/records.py): when each was sent, its first token, every later token. For
new limits each stored probe is judged again as the search would have judged it at those limits (the same probe
rule, measurement/probe_rule.py, on the same requests), and the re-judged probes are pooled by the same fit
(measurement/rate_search.py::fit_at_limits) into a rate at the new limits with its 95% interval.

What the stored requests cannot tell is said, not guessed:
- a probe stopped early by the study's own verdict holds only the requests sent until then: judged again, it may be
  unsettled at the new limits, and it is then judged on its counts as they stand;
- a trial whose every probe misses the new limits never probed the lower rates they need: it cannot be ranked for
  them without running again (`Rejudged.unprobed_below_rps`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from optimizer.config.limits import Limits
from optimizer.config.settings import StudyConfig
from optimizer.measurement.metrics import RequestRecord, summarize
from optimizer.measurement.probe_rule import ProbeRule
from optimizer.measurement.rate_fit import RateAtLimit
from optimizer.measurement.rate_search import CurvePoint, fit_at_limits
from optimizer.search.measured import TrialMeasurement, measurement_of
from optimizer.search.records import RecordStore

Replay = tuple[float, list[RequestRecord]]  # (offered rate, its requests), as RecordStore.load gives them


@dataclass(frozen=True)
class Rejudged:
    """One trial's stored probes judged again at other limits."""

    curve: list[dict[str, Any]]  # every replay as a curve point judged at the new limits, in the order run
    fit: RateAtLimit | None  # the pooled fit at the new limits (None: no probe passed, or none has counts)
    fit_limit: str | None

    @property
    def unprobed_below_rps(self) -> float | None:
        """The lowest Poisson rate the trial probed, where it missed the new limits at every rate: it never probed
        below it, where they might hold (None: some probe met them)."""
        return None if any(p.get("feasible") for p in self.curve) else lowest_rate_rps(self.curve)


def lowest_rate_rps(curve: Sequence[dict[str, Any]]) -> float | None:
    """The lowest Poisson rate among stored curve points (None: none, or bursts only)."""
    return min((p["offered_rate_rps"] for p in curve if p.get("offered_rate_rps") is not None), default=None)


def rejudge_replay(rate_rps: float, records: Sequence[RequestRecord], stored: dict[str, Any],
                   config: StudyConfig, limits: Limits) -> CurvePoint:
    """One stored replay judged at `limits`, at the rate the trial stored it at (a closed-loop replay's: its achieved
    rate): a probe sized by evidence (it stored a verdict) by the probe rule on its requests in send order, a replay of
    fixed length by its statistics."""
    spec = config.workload
    metrics = summarize(list(records), rate_rps, spec.skip_first_fraction, spec.skip_last_fraction)
    if stored.get("verdict") is not None:
        cap = min(spec.num_requests, len(spec.trace)) if spec.trace else spec.num_requests  # the workload's length
        rule = ProbeRule(limits, cap, 1 - config.search.probe_confidence)
        evidence = rule.evidence(sorted(records, key=lambda r: (r.sent_s, r.index)))
        point = CurvePoint.of_probe(metrics, evidence, limits)
    else:
        point = CurvePoint.of(metrics, limits)
    stored_rate = stored.get("offered_rate_rps")
    return replace(point, offered_rate_rps=math.inf if stored_rate is None else float(stored_rate))


def rejudge(measured: TrialMeasurement, replays: Sequence[Replay], config: StudyConfig,
            limits: Limits) -> Rejudged | None:
    """The trial's stored probes judged at `limits`, and their pooled fit; None where its requests were not stored
    (each stored curve point needs its replay's requests)."""
    if not replays or len(replays) != len(measured.curve):
        return None
    points = [rejudge_replay(rate, records, stored, config, limits)
              for (rate, records), stored in zip(replays, measured.curve)]
    curve = [{**p.to_dict(), **({"engine": s["engine"]} if s.get("engine") else {})}  # its engine stats kept
             for p, s in zip(points, measured.curve)]
    fit, key = fit_at_limits(points)
    return Rejudged(curve, fit, key)


def rejudge_trials(trials: Sequence[Any], store: RecordStore, config: StudyConfig,
                   limits: Limits) -> dict[int, Rejudged]:
    """Each measured trial of the study judged again at `limits` from its stored requests, by trial number (a trial
    whose requests were not stored is left out: it is ranked on its stored statistics)."""
    out = {}
    for t in trials:
        m = measurement_of(t)
        if m is None or not m.curve:
            continue
        found = rejudge(m, store.load(config.study_name, t.number), config, limits)
        if found is not None:
            out[t.number] = found
    return out
