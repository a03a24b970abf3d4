"""Every user attribute the optimizer stores with a trial or a study, in one place: its key in the database, the
type of its value, what it means, and what a reader gets where it is missing (a trial that ended before it was
written, a study made without it).

The keys are the stored form. Code reads and writes the attributes through these fields, never by a string of its
own:

    CONFIRM.of(trial)["round"]              # trial.user_attrs.get("confirm")
    LIMITED_BY.set(trial, line)             # trial.set_user_attr("limited_by", line)
    study.enqueue_trial({}, user_attrs=BASELINE.item(True))
    STUDY_CONFIG.of(study)                  # study.user_attrs.get("optimizer_config")

`of` takes anything with `user_attrs` (optuna.Trial, FrozenTrial, Study); `set` anything with `set_user_attr`.
A trial's measurement (RESULT and CURVE) is written and read only through search/measured.py, as one typed value.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")


class HasUserAttrs(Protocol):
    """A trial (running or frozen) or a study."""

    @property
    def user_attrs(self) -> dict[str, Any]: ...

    def set_user_attr(self, key: str, value: Any) -> None: ...


@dataclass(frozen=True, eq=False)  # each field is one attribute: compared and hashed by identity
class Attr(Generic[T]):
    """One user attribute of a trial: its stored key, the value where it is missing, and what it means."""

    key: str
    default: T
    meaning: str

    def of(self, holder: HasUserAttrs) -> T:
        """The stored value, or a fresh copy of the default where the key is missing."""
        stored = holder.user_attrs
        return stored[self.key] if self.key in stored else copy.copy(self.default)

    def set(self, holder: HasUserAttrs, value: T) -> None:
        holder.set_user_attr(self.key, value)

    def item(self, value: T) -> dict[str, T]:
        """{key: value}: the attribute as `study.enqueue_trial(user_attrs=...)` takes it."""
        return {self.key: value}


class StudyAttr(Attr[T]):
    """One user attribute of the study itself (`study.user_attrs`), not of one of its trials."""


Json = dict[str, Any]

# --- on a trial: what it is --------------------------------------------------------------------------------------
BASELINE: Attr[bool] = Attr("baseline", False, "vLLM's defaults: queued with it, the study's reference trial")
RETRY_OF: Attr[int | None] = Attr("retry_of", None, "the interrupted trial's number that this one runs again")
PRESCREEN: Attr[str | None] = Attr("prescreen", None, "queued by the pre-screen: 'top' or 'unsure'")
SIM_GOODPUT_TOK_S: Attr[float | None] = Attr("sim_goodput_tok_s", None, "a pre-screen pick's simulated goodput")
RUN: Attr[bool] = Attr("run", False, "benchmarks/repeatability.py: one of its repeated runs")
AB: Attr[str | None] = Attr("ab", None, "benchmarks/ab_gain.py: which side of the A/B ('defaults', 'recommended')")
CONFIRM: Attr[Json | None] = Attr("confirm", None, "a confirmation run, stored in the study NAME.confirmation, not a "
                                                   "search trial: {plan, of (the trial it measures again), round, "
                                                   "workload_seed, start_rps, failed_rps, step (where its search "
                                                   "starts)} (search/confirm.py)")

# --- on a trial: who ran it, and its engine's processes ------------------------------------------------------------
WORKER: Attr[Json | None] = Attr("worker", None, "the optimize process running it: {host, pid, create_time}")
GPUS: Attr[Json | None] = Attr("gpus", None, "the GPUs it was given from the study's pool (--gpus): {indices, uuids, "
                                             "cpus, reserved_unix_s, released_unix_s, host (--ray)}; None without a "
                                             "pool")
NODES: Attr[list[Json]] = Attr("nodes", [], "the cluster nodes its task started on, in order (--ray): [{host, node}]; "
                                            "more than one where a node was lost and the task retried on another")
ENGINE_PROCESSES: Attr[list[list[float]]] = Attr("engine_processes", [], "its engine's processes: [[pid, create_time]]")
ENGINE_PIDS: Attr[list[int]] = Attr("engine_pids", [], "its engine's PIDs, for a person reading the study")
INTERRUPTED: Attr[str | None] = Attr("interrupted", None, "why it ended FAIL without a result (queued again)")
ENVIRONMENT_CAUSE: Attr[str | None] = Attr("environment_cause", None,
                                           "the machine's fault that stopped its engine's start (breaker.py)")

# --- on a trial: how its engine ran ---------------------------------------------------------------------------------
ENGINE_PARAMS: Attr[Json] = Attr("engine_params", {}, "the engine arguments it ran: the sampled and fixed knobs")
ENGINE_CONFIG: Attr[Json] = Attr("engine_config", {}, "the engine's resolved config, as the engine reported it")
BASELINE_NOTE: Attr[str | None] = Attr("baseline_note", None, "why the baseline runs a memory fraction of its own")
MEMORY_WAITED_FOR: Attr[str | None] = Attr("memory_waited_for", None, "what memory it waited for before its start")
MEMORY_ESTIMATE_GIB: Attr[Json | None] = Attr("memory_estimate_gib", None, "the preflight memory estimate, GiB")
LOG_FILE: Attr[str | None] = Attr("log_file", None, "the path of its engine log")
LOG_EXCERPT: Attr[str | None] = Attr("log_excerpt", None, "the end of its engine log, where its engine died")
ENGINE_START_PHASES: Attr[Json | None] = Attr("engine_start_phases", None, "compile and graph capture in the start")
TELEMETRY: Attr[Json | None] = Attr("telemetry", None, "device telemetry during its replays (measurement/telemetry)")
MACHINE_LOAD: Attr[Json | None] = Attr("machine_load", None, "what other processes and the hypervisor took of its "
                                                             "CPUs during its replays (measurement/disturbance)")
TIMINGS: Attr[dict[str, float]] = Attr("timings", {}, "engine_start_s, replay_s, engine_shutdown_s, overhead_s, "
                                                        "total_s")

# --- on a trial: what it measured, or why it could not -------------------------------------------------------------
CURVE: Attr[list[Json]] = Attr("curve", [], "every replay in the order run: a CurvePoint dict, with 'engine' stats")
RESULT: Attr[Json] = Attr("result", {}, "its measurement but the curve: search/measured.py's TrialMeasurement, "
                                        "stored by `to_stored` with its schema version and read by `measurement_of`")
LIMITED_BY: Attr[str | None] = Attr("limited_by", None, "one line: what limited it at its chosen point")
PRUNED_REASON: Attr[str | None] = Attr("pruned_reason", None, "why it cannot run: a core/failures.py class")
PRUNED_DETAIL: Attr[str] = Attr("pruned_detail", "", "the message behind pruned_reason, at most 1000 characters")

TRIAL_ATTRS: tuple[Attr[Any], ...] = (
    BASELINE, RETRY_OF, PRESCREEN, SIM_GOODPUT_TOK_S, RUN, AB, CONFIRM, WORKER, GPUS, NODES, ENGINE_PROCESSES,
    ENGINE_PIDS, INTERRUPTED,
    ENVIRONMENT_CAUSE, ENGINE_PARAMS, ENGINE_CONFIG, BASELINE_NOTE, MEMORY_WAITED_FOR, MEMORY_ESTIMATE_GIB, LOG_FILE,
    LOG_EXCERPT, ENGINE_START_PHASES, TELEMETRY, MACHINE_LOAD, TIMINGS, CURVE, RESULT, LIMITED_BY, PRUNED_REASON,
    PRUNED_DETAIL,
)

# --- on the study ---------------------------------------------------------------------------------------------------
STUDY_CONFIG: StudyAttr[str | None] = StudyAttr("optimizer_config", None,
                                                "the StudyConfig as JSON (no password): made by optimize")
STUDY_MACHINE: StudyAttr[Json | None] = StudyAttr("machine", None, "the fingerprint of the machine it was made on")
STUDY_CREATED: StudyAttr[str | None] = StudyAttr("created", None, "when the study was made: ISO 8601, UTC")
STUDY_DEMO_SCALE: StudyAttr[Json | None] = StudyAttr("demo_scale", None, "the demo's probe and its chosen scale: "
                                                                         "{probe, scale}")
STUDY_REQUESTS_CHOICE: StudyAttr[Json | None] = StudyAttr("num_requests_choice", None,
                                                          "`--num-requests auto`: the count and the evidence")
STUDY_PRESCREEN: StudyAttr[Json | None] = StudyAttr("prescreen", None, "the pre-screen's simulated study and "
                                                                       "picks (set once)")
STUDY_P99_STABILITY: StudyAttr[Json | None] = StudyAttr("p99_stability", None,
                                                        "how well the recommendation's replay pinned TTFT P99")
STUDY_VERIFY: StudyAttr[Json | None] = StudyAttr("verify", None, "`optimize verify`'s results and its choice")
STUDY_CONFIRMATION: StudyAttr[Json | None] = StudyAttr("confirmation", None, "the confirmation's plan: {plan, rounds, "
                                                       "candidates, baseline, why} (search/confirm.py)")
STUDY_CONFIRMS: StudyAttr[str | None] = StudyAttr("confirms", None, "on a study NAME.confirmation: NAME, the study "
                                                                    "whose confirmation runs it holds")

STUDY_ATTRS: tuple[StudyAttr[Any], ...] = (
    STUDY_CONFIG, STUDY_MACHINE, STUDY_CREATED, STUDY_DEMO_SCALE, STUDY_REQUESTS_CHOICE, STUDY_PRESCREEN,
    STUDY_P99_STABILITY, STUDY_VERIFY, STUDY_CONFIRMATION, STUDY_CONFIRMS,
)
