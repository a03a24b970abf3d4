"""The decision as rows and lines: the Pareto front, the parameters, the summary, a trial's curve."""

from __future__ import annotations

import json
import math
from typing import Any

from optimizer.config.limits import key_name
from optimizer.decision.decide import Decision, rate_text, resolution, values_text, view
from optimizer.decision.numbers import gain_statistic, interval_text, throughput_statistic
from optimizer.decision.served import IN_PROCESS, served_cell, served_lines, served_record
from optimizer.decision.tables import limit_column
from optimizer.decision.trial import TrialView
from optimizer.decision.verdict import verdict_line
from optimizer.measurement.noise import median
from optimizer.measurement.rerank import Answer, point_value_ms, qualifies
from optimizer.params.space import SEARCHABLE, distance_to_default
from optimizer.search.attrs import LIMITED_BY, PRUNED_REASON, TELEMETRY
from optimizer.search.confirmed import Confirmed
from optimizer.search.score import fit_text, rate_at_limit_text
from optimizer.search.study import run_name


def _role(d: Decision, v: TrialView, tied: frozenset[int] = frozenset()) -> str:
    roles = (["recommended"] if d.best is v else []) + (["baseline"] if v.baseline else []) \
        + (["tied"] if v.number in tied else [])
    return ", ".join(roles)


def limit_values(d: Decision, p: Any) -> dict[str, float | None]:
    """Each of the decision's limits' statistic at a stored point, by its column ('tpot_p90_ms': 41.2; None where the
    point did not store it)."""
    out: dict[str, float | None] = {}
    for lim in d.limits:
        value = point_value_ms(p, lim, d.limits) if p else math.nan
        out[limit_column(lim, d.limits)] = value if math.isfinite(value) else None
    return out


def trial_row(d: Decision, v: TrialView, params: list[str], tied: frozenset[int] = frozenset()) -> dict[str, Any]:
    """One trial's row: the chosen point's numbers (units in the keys; each limit's statistic among them), the rate it
    failed above them (its bracket), whether the measurements tie it with the recommendation, and its engine
    values."""
    p = v.ranked.point or {}
    cfg = v.engine_config
    fit = v.fit_under(d.reranked)  # the study's own limits: its stored fit; others: its probes judged again
    return {
        "trial": v.number,
        "role": _role(d, v, tied),
        "output_throughput_tok_s": p.get("output_throughput_tok_s"),
        "arrivals": None if not p else "burst" if p.get("offered_rate_rps") is None else d.arrivals,
        "rate_at_limit_rps": None if fit is None else fit.rate_rps,
        "rate_low_rps": None if fit is None else fit.low_rps,
        "rate_high_rps": None if fit is None or not math.isfinite(fit.high_rps) else fit.high_rps,
        "rate_rps": p.get("offered_rate_rps"),
        "failed_rate_rps": v.ranked.next_rate_rps,
        "ttft_p50_ms": p.get("ttft_p50_ms"),
        "ttft_p99_ms": p.get("ttft_p99_ms"),
        "tpot_p99_ms": p.get("tpot_p99_ms"),
        **limit_values(d, p),
        "answer": v.ranked.answer.value,
        **{k: cfg.get(k) for k in params},
    }


def _shown_params(d: Decision) -> list[str]:
    """Searched parameters whose values differ across the front and the baseline."""
    shown = [*d.front, *([d.baseline] if d.baseline is not None and d.baseline not in d.front else [])]
    return [k for k in SEARCHABLE if any(k in v.engine_config for v in shown)
            and (len(shown) == 1 or len({json.dumps(v.engine_config.get(k)) for v in shown}) > 1)]


def front_rows(d: Decision, with_params: bool = True) -> list[dict[str, Any]]:
    """The feasible Pareto front as rows, highest throughput first, with the engine parameters that differ."""
    params = _shown_params(d) if with_params else []
    tied = frozenset(v.number for v in d.ties)
    return [trial_row(d, v, params, tied) for v in d.front]


def params_rows(d: Decision) -> list[dict[str, Any]]:
    """The same parameters transposed, one row per parameter, one column per front trial (and the baseline)."""
    shown = [*d.front, *([d.baseline] if d.baseline is not None and d.baseline not in d.front else [])]
    names = {v.number: f"#{v.number}" + (f" ({_role(d, v)})" if _role(d, v) else "") for v in shown}

    def cell(v: TrialView, k: str) -> Any:  # the baseline's value that is not vLLM's own says so
        value = v.engine_config.get(k)
        return f"{value} (not vLLM's default)" if v.baseline and k in d.defaults_as_run else value

    return [{"parameter": k, **{names[v.number]: cell(v, k) for v in shown}} for k in _shown_params(d)]


def _describe(d: Decision, v: TrialView) -> str:
    r = v.ranked
    if not r.answerable:
        return f"trial #{v.number}: {r.answer.value}"
    fit, fitted = v.fit_under(d.reranked), ""
    if fit is not None and d.reranked:  # its probes judged again at the report's limits
        fitted = f"{fit_text(fit)}; "
    elif fit is not None and v.measured is not None:  # as its search measured it
        fitted = f"{rate_at_limit_text(v.measured)}; "
    search = (f"{fitted}{r.output_throughput_tok_s:.1f} output tok/s at {rate_text(r.rate_rps)}, "
              f"{values_text(r.point, d.limits)} ({r.answer.value})")
    shown = d.throughput(v)
    return f"trial #{v.number}: {shown.text()}; in the search: {search}" if shown.confirmed else \
        f"trial #{v.number}: {search}"


def defaults_as_run_text(d: Decision) -> str:
    """What the baseline ran with that is not vLLM's default, and why: 'gpu_memory_utilization=0.2 (this machine's
    fallback: ...); enforce_eager=True (the CPU build's setting, set for every trial)'; '' where nothing."""
    return "; ".join(f"{k}={v} ({why})" for k, (v, why) in d.defaults_as_run.items())


def defaults_as_run_line(d: Decision) -> str | None:
    """Where the baseline is not quite vLLM's defaults: what it ran with instead, and why (none of it tuned)."""
    if not d.defaults_as_run:
        return None
    return f"vLLM's defaults ({d.defaults_of}) as this study ran them, not tuned: {defaults_as_run_text(d)}"


def summary_lines(d: Decision) -> list[str]:
    """Recommendation, baseline, gain, changed parameters, importances and caveats, one sentence a line."""
    out = []
    out.append(f"recommended: {_describe(d, d.best)}" if d.best is not None else
               "recommended: none: no trial meets the limit")
    if d.baseline is not None:
        out.append(f"vLLM defaults ({d.defaults_of}, baseline): {_describe(d, d.baseline)}")
        as_run = defaults_as_run_line(d)
        if as_run:
            out.append(as_run)
    if d.confirmed:
        out += confirmation_lines(d)[1:]
    elif d.best is not None and d.best is d.baseline:
        out.append(f"the recommendation is vLLM's defaults ({d.defaults_of}): keep them; no trial measured more")
    elif d.gain_pct is not None and d.best is not None and d.baseline is not None:
        bounds = d.best.ranked.answer == Answer.LOWER_BOUND, d.baseline.ranked.answer == Answer.LOWER_BOUND
        qualifier = ("; the baseline's number is a lower bound too, so the gain is uncertain" if bounds[1] else
                     "; at least that much, as the recommendation's number is a lower bound" if bounds[0] else "")
        if not d.beyond_noise(d.best, d.baseline):
            qualifier += (f"; tied: within measurement noise ({_noise_text(d, d.best, d.baseline)}): not proven "
                          f"better than vLLM's defaults (--confirm N measures both again, with intervals)")
        out.append(f"gain over vLLM's defaults ({d.defaults_of}): {d.gain_pct:+.1f}% output throughput "
                   f"(one measurement each){qualifier}")
    ties = [v for v in d.ties if v is not d.baseline]  # the gain line speaks of the baseline
    if ties and not d.confirmed:
        out.append("tied with the recommendation (their brackets, the rate passed to the rate failed, overlap): "
                   + ", ".join(f"#{v.number} ({v.ranked.output_throughput_tok_s:.1f} tok/s)" for v in ties)
                   + f"; `optimize verify --study {d.study_name}` picks the most robust of them")
    if d.best is not None and d.baseline is not None and d.best is not d.baseline:
        changed = distance_to_default(d.best.engine_config, d.baseline.engine_config)
        if changed:
            here = " (from the baseline's value on this machine, not vLLM's default)"
            out.append("changed from vLLM's defaults: " + ", ".join(
                f"{k} {a} -> {b}{here if k in d.defaults_as_run else ''}" for k, (a, b) in changed.items()))
    if d.importances:
        out.append(f"parameter importance ({d.importance_note}): "
                   + ", ".join(f"{k} {v:.2f}" for k, v in d.importances.items() if v >= 0.005))
    else:
        out.append(f"parameter importance: {d.importance_note}")
    out += [f"note: {n}" for n in d.notes]
    return out


def _role_in_confirmation(d: Decision, conf: Confirmed, v: TrialView) -> str:
    c = d.confirmation
    assert c is not None
    roles = ([f"vLLM defaults ({d.defaults_of})"] if conf.baseline else []) + (["recommended"] if d.best is v else []) \
        + (["tied"] if c.tied(conf) else [])
    return ", ".join(roles) or "measured again"


def _median_or_none(values: list[float]) -> float | None:
    return median(values) if values else None


def confirmation_records(d: Decision) -> list[dict[str, Any]]:
    """The confirmed configs, vLLM's defaults first, as typed values (units in the keys): each one's rounds, median
    throughput with the 95% interval of the mean, gain over the defaults (the ratio of the medians) with the 95%
    interval of the mean per-round ratio, the median rate passed and failed, its search number and its runs."""
    c = d.confirmation
    assert c is not None
    rows = []
    for conf in c.configs:
        v = view(d, conf.number)
        tp, gain = d.throughput(v), d.gain(v)
        rows.append({
            "trial": conf.number, "role": _role_in_confirmation(d, conf, v), "rounds": tp.rounds,
            "output_throughput_tok_s": tp.output_throughput_tok_s, "low_tok_s": tp.low_tok_s,
            "high_tok_s": tp.high_tok_s,
            "gain_pct": gain.pct if gain is not None else None,
            "gain_low_pct": gain.low_pct if gain is not None else None,
            "gain_high_pct": gain.high_pct if gain is not None else None,
            "rate_rps": _median_or_none([p for r in c.full_rounds if (p := conf.bracket_rps(r)[0]) is not None]),
            "failed_rate_rps": _median_or_none([f for r in c.full_rounds
                                                if (f := conf.bracket_rps(r)[1]) is not None]),
            "search_output_throughput_tok_s": v.ranked.output_throughput_tok_s if v.ranked.answerable else None,
            "values_tok_s": c.values_tok_s(conf),  # by full round
            "runs": [run_name(conf.runs[r]) for r in sorted(conf.runs)],  # by round, by name (`--trial c3`)
            **served_record(c, conf),
        })
    return rows


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None or math.isnan(x) else format(x, fmt)


def confirmation_row(r: dict[str, Any]) -> dict[str, Any]:
    """One of `confirmation_records` as the table shows it (`confirmation_rows`); each header names its statistic.
    A config that met the limit in no round (0 tok/s stored) reads "misses", not 0 req/s and -100% as if measured."""
    misses = bool(r["values_tok_s"]) and not any(v > 0 for v in r["values_tok_s"])
    known = r["low_tok_s"] is not None and r["high_tok_s"] is not None and not misses
    gain_known = r["gain_low_pct"] is not None and r["gain_high_pct"] is not None and not misses
    return {
        "config": r["role"] + (": met the limit in no round" if misses else ""), "trial": f"#{r['trial']}",
        "rounds": r["rounds"], "tok/s (median)": "misses" if misses else _num(r["output_throughput_tok_s"]),
        "95% interval of the mean": interval_text(r["low_tok_s"], r["high_tok_s"]) if known else "-",
        "gain (ratio of medians)": "-" if r["gain_pct"] is None or misses else f"{r['gain_pct']:+.1f}%",
        "per-round gain, 95% interval": "-" if not gain_known else
        interval_text(r["gain_low_pct"], r["gain_high_pct"], pct=True),
        "req/s at the limit, in process (median)": "misses" if misses else _num(r["rate_at_limit_rps"], ".2f"),
        "req/s at the limit, as served (vllm serve)": served_cell(r),
        "in the search tok/s": "misses" if r["search_output_throughput_tok_s"] is None else
        _num(r["search_output_throughput_tok_s"])}


def confirmation_rows(d: Decision) -> list[dict[str, Any]]:
    return [confirmation_row(r) for r in confirmation_records(d)]


def confirmation_lines(d: Decision) -> list[str]:
    """The confirmation's title (how it measured, what each column's statistic is), then its verdict in sentences:
    the gain with its interval, and what is tied."""
    c = d.confirmation
    assert c is not None and d.best is not None
    rounds = len(c.full_rounds)
    done = f"{rounds} rounds" if rounds == c.rounds else f"{rounds} of {c.rounds} planned rounds"
    out = [(f"{d.limits.text}; confirmed in {done}, alternating, each config on a fresh "
            f"engine {IN_PROCESS}, its rate at the limit found by probes sized by evidence.\n"
            f"tok/s: the {throughput_statistic(c)}; gain over vLLM's defaults: the {gain_statistic(c)}")]
    out.append(verdict_line(d))
    tied = [x for x in c.configs if c.tied(x) and not x.baseline]
    if tied:
        out.append("tied with the recommendation (the rounds do not rank them apart): "
                   + ", ".join(f"#{x.number} ({c.interval(x).median:.1f} tok/s)" for x in tied)
                   + f"; `optimize verify --study {d.study_name}` picks the most robust of them")
    out += served_lines(d)
    if not c.complete:
        out.append(f"note: the confirmation stopped before it decided ({c.runs_done} runs of up to "
                   f"{c.runs_planned}): run the same command again to go on")
    elif missing := c.served_missing:
        out.append("note: the runs through `vllm serve` stopped before " + ", ".join(
            f"#{x.number}" for x in missing) + " ran: run the same command again to measure them as served")
    return out


def _noise_text(d: Decision, a: TrialView, b: TrialView) -> str:
    why = []
    if not math.isnan(d.noise_cv):
        why.append(f"replays at one rate vary by CV {d.noise_cv:.1%}")
    if resolution(b) > 0:
        why.append(f"#{b.number}'s best rate is known within {resolution(b):.1%} (the next rate tried missed)")
    return f"a gain must exceed {d.required_gain(a, b):.1%}: " + "; ".join(why)


def title(d: Decision) -> str:
    how = "re-ranked from stored replays" if d.reranked else "as searched"
    return (f"study {d.study_name!r}: feasible Pareto front of output throughput vs {d.limits.first.name}, "
            f"{d.limits.text} ({how})")


def curve_rows(d: Decision, v: TrialView) -> list[dict[str, Any]]:
    """A trial's stored replays in the order they ran: its latency-vs-load curve, judged under the decision's limits,
    with each probe's counts (requests resolved, how many over the limit, its verdict; with several limits, the counts
    of the one its verdict rests on, `binding`) and each limit's statistic. A burst has no offered or sent rate (every
    request goes at once); the engine's KV cache peak is in percent."""
    keys = ("offered_rate_rps", "requests", "over_limit", "verdict", "sent_rate_rps", "achieved_rate_rps",
            "output_throughput_tok_s", "request_throughput_rps", "ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms",
            "itl_p99_ms", "e2e_p99_ms", "completed", "failed", "sustained")
    engine_keys = ("running_peak", "queued_p99_ms", "prefill_p99_ms", "preemptions")
    with_engine = any(p.get("engine") for p in v.curve)  # the engine's own view, where the engine reports it
    rows = []
    for i, p in enumerate(v.curve):
        burst = p.get("offered_rate_rps") is None
        engine = p.get("engine") or {}
        kv = engine.get("kv_usage_peak")
        rows.append({
            "replay": i, "arrivals": "burst" if burst else d.arrivals,
            **{k: None if burst and k == "sent_rate_rps" else p.get(k) for k in keys},
            **limit_values(d, p),
            "binding": key_name(p["binding"]) if p.get("binding") and len(d.limits) > 1 else None,
            "meets_limit": qualifies(p, d.limits),
            "chosen": v.ranked.point is not None  # every replay at the chosen rate (repeats are merged)
            and p.get("offered_rate_rps") == v.ranked.point.get("offered_rate_rps"),
            **({**{f"engine_{k}": engine.get(k) for k in engine_keys},
                "engine_kv_usage_peak_pct": None if kv is None else round(kv * 100, 1)} if with_engine else {})})
    return rows


def config_text(d: Decision, v: TrialView) -> str:
    """The searched engine parameters `v` ran with, 'max_num_seqs=8, enable_chunked_prefill=False, ...'; the
    baseline's values that are not vLLM's own say so."""
    cfg = v.engine_config
    here = d.defaults_as_run if v.baseline else {}
    return ", ".join(f"{k}={cfg[k]}" + (" (not vLLM's default: see below)" if k in here else "")
                     for k in SEARCHABLE if k in cfg) or "(no engine config stored)"


def trial_heading(d: Decision, v: TrialView, of: TrialView | None = None) -> list[str]:
    """Above a trial's curve: which trial, its role and its engine parameters. For a confirmation run, `of` is the
    search trial it measured again: the run's round and result, then that config."""
    from optimizer.search.confirm import describe

    if of is None:
        role = _role(d, v, frozenset(x.number for x in d.ties))
        out = [f"trial #{v.number}" + (f" ({role})" if role else "") + f": {config_text(d, v)}"]
        target = v
    else:
        role = _role(d, of, frozenset(x.number for x in d.ties))
        out = [describe(v.trial),
               f"it measured trial #{of.number}" + (f" ({role})" if role else "") + f" again: {config_text(d, of)}"]
        target = of
    as_run = defaults_as_run_line(d) if target.baseline else None
    return [*out, *([as_run] if as_run else [])]


def limited_by_line(v: TrialView) -> str | None:
    """What limited the trial at its chosen point: the limit that bound it (stored with it), then its engine stats
    there (else the line stored with it)."""
    from optimizer.measurement.limits import diagnose

    point = v.ranked.point
    bound = v.measured.bound if v.measured is not None else None
    found = diagnose(point.get("engine"), point.get("ttft_p99_ms"), bound and bound.text,
                     bound.limit_key.partition(":")[0] if bound else None) if point else None
    return found.line if found else LIMITED_BY.of(v.trial)


def trial_reason(v: TrialView) -> str:
    """Why the trial stands where it does, in words: why it could not run, that it met the limit at no rate
    stored, or what limited it at its chosen point."""
    reason = PRUNED_REASON.of(v.trial)
    if reason:
        return f"cannot run: {reason}"
    if not v.ranked.answerable:
        return f"{v.ranked.answer.value}: no stored replay meets the limit"
    return limited_by_line(v) or v.ranked.answer.value


def trial_notes(v: TrialView) -> list[str]:
    """Under a trial's curve: what limited it at its chosen point (engine stats) and its GPU telemetry."""
    out = []
    line = limited_by_line(v)
    if line:
        out.append(line)
    tele = TELEMETRY.of(v.trial)
    if tele and tele.get("available"):
        u = tele.get("utilization") or f"mean {tele['utilization_mean_pct']}% max {tele['utilization_max_pct']}%"
        out.append(f"GPU {tele.get('device')}: utilization {u}, memory used max {tele.get('memory_used_max_gib')} "
                   f"GiB ({tele.get('samples')} samples)")
    elif tele:
        out.append(f"GPU telemetry: none ({tele.get('reason')})")
    return out


def confirmation_run_lines(d: Decision, v: TrialView) -> list[str]:
    """Under a trial's curve: its confirmation runs, a line each (none where it was not measured again)."""
    from optimizer.search.confirm import describe

    mine = d.confirmed_of(v)
    if mine is None:
        return []
    return [describe(mine.runs[r]) for r in sorted(mine.runs)] + ([describe(mine.served)] if mine.served else [])


def role_text(d: Decision, v: TrialView) -> str:
    """`v`'s role in the decision in words: 'recommended', 'baseline', 'tied', joined; '' for none."""
    return _role(d, v, frozenset(x.number for x in d.ties))
