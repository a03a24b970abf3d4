"""The decision as rows and lines: the Pareto front, the parameters, the summary, a trial's curve."""

from __future__ import annotations

import json
import math
from typing import Any

from optimizer.core.units import format_ms
from optimizer.decision.decide import Decision, rate_text, resolution
from optimizer.decision.tables import check_format, format_output
from optimizer.decision.trial import TrialView
from optimizer.measurement.noise import median
from optimizer.measurement.rerank import Answer, qualifies
from optimizer.params.space import SEARCHABLE, distance_to_default
from optimizer.search.attrs import LIMITED_BY, RESULT, TELEMETRY
from optimizer.search.score import rate_at_limit_text


def _role(d: Decision, v: TrialView, tied: frozenset[int] = frozenset()) -> str:
    roles = (["recommended"] if d.best is v else []) + (["baseline"] if v.baseline else []) \
        + (["tied"] if v.number in tied else [])
    return ", ".join(roles)


def trial_row(d: Decision, v: TrialView, params: list[str], tied: frozenset[int] = frozenset()) -> dict[str, Any]:
    """One trial's row: the chosen point's numbers (units in the keys), the rate it failed above them (its bracket),
    whether the measurements tie it with the recommendation, and its engine values."""
    p = v.ranked.point or {}
    cfg = v.engine_config
    # the trial's own fit answers its study's limit only (another limit re-ranks the stored probes)
    fit = (RESULT.of(v.trial).get("rate_at_limit") or {}) if not d.reranked else {}
    return {
        "trial": v.number,
        "role": _role(d, v, tied),
        "output_throughput_tok_s": p.get("output_throughput_tok_s"),
        "arrivals": None if not p else "burst" if p.get("offered_rate_rps") is None else d.arrivals,
        "rate_at_limit_rps": fit.get("rate_rps"),
        "rate_low_rps": fit.get("low_rps"),
        "rate_high_rps": fit.get("high_rps"),
        "rate_rps": p.get("offered_rate_rps"),
        "failed_rate_rps": v.ranked.next_rate_rps,
        "ttft_p50_ms": p.get("ttft_p50_ms"),
        "ttft_p99_ms": p.get("ttft_p99_ms"),
        "tpot_p99_ms": p.get("tpot_p99_ms"),
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
    return [{"parameter": k, **{names[v.number]: v.engine_config.get(k) for v in shown}} for k in _shown_params(d)]


def _describe(v: TrialView, reranked: bool = False) -> str:
    r = v.ranked
    if not r.answerable:
        return f"trial #{v.number}: {r.answer.value}"
    result = RESULT.of(v.trial)
    fitted = f"{rate_at_limit_text(result)}; " if result.get("rate_at_limit") and not reranked else ""
    return (f"trial #{v.number}: {fitted}{r.output_throughput_tok_s:.1f} output tok/s at {rate_text(r.rate_rps)}, "
            f"TTFT P99 {format_ms(r.ttft_p99_ms)} ({r.answer.value})")


def summary_lines(d: Decision) -> list[str]:
    """Recommendation, baseline, gain, changed parameters, importances and caveats, one sentence a line."""
    out = []
    out.append(f"recommended: {_describe(d.best, d.reranked)}" if d.best is not None else
               "recommended: none: no trial meets the limit")
    if d.baseline is not None:
        out.append(f"vLLM defaults ({d.defaults_of}, baseline): {_describe(d.baseline, d.reranked)}")
    if d.confirmed:
        out += confirmation_lines(d)[1:]
    elif d.gain_pct is not None and d.best is not None and d.baseline is not None:
        bounds = d.best.ranked.answer == Answer.LOWER_BOUND, d.baseline.ranked.answer == Answer.LOWER_BOUND
        qualifier = ("; the baseline's number is a lower bound too, so the gain is uncertain" if bounds[1] else
                     "; at least that much, as the recommendation's number is a lower bound" if bounds[0] else "")
        if not d.beyond_noise(d.best, d.baseline) and d.best is not d.baseline:
            qualifier += (f"; tied: within measurement noise ({_noise_text(d, d.best, d.baseline)}): not proven "
                          f"better than vLLM's defaults (--confirm N measures both again, with intervals)")
        out.append(f"gain over vLLM's defaults ({d.defaults_of}): {d.gain_pct:+.1f}% output throughput "
                   f"(one measurement each){qualifier}")
    ties = [v for v in d.ties if v is not d.baseline]  # the gain line speaks of the baseline
    if ties and not d.confirmed:
        out.append("tied with the recommendation (their brackets, the rate passed to the rate failed, overlap): "
                   + ", ".join(f"#{v.number} ({v.ranked.output_throughput_tok_s:.1f} tok/s)" for v in ties)
                   + "; optimize verify picks the most robust of them")
    if d.best is not None and d.baseline is not None and d.best is not d.baseline:
        changed = distance_to_default(d.best.engine_config, d.baseline.engine_config)
        if changed:
            out.append("changed from vLLM's defaults: " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()))
    if d.importances:
        out.append(f"parameter importance ({d.importance_note}): "
                   + ", ".join(f"{k} {v:.2f}" for k, v in d.importances.items() if v >= 0.005))
    else:
        out.append(f"parameter importance: {d.importance_note}")
    out += [f"note: {n}" for n in d.notes]
    return out


def _interval_text(low: float, high: float, pct: bool = False) -> str:
    if pct:
        return f"[{low * 100:+.1f}%, {high * 100:+.1f}%]"
    return f"[{low:.1f}, {high:.1f}]"


def confirmation_rows(d: Decision) -> list[dict[str, Any]]:
    """The confirmed configs, vLLM's defaults first: each one's median over the full rounds with its 95% interval,
    its gain over the defaults with its interval, the rate bracket of its median round and its search number."""
    c = d.confirmation
    assert c is not None
    rows = []
    for conf in c.configs:
        v = next(x for x in d.views if x.number == conf.number)
        iv = c.interval(conf)
        role = f"vLLM defaults ({d.defaults_of})" if conf.baseline else (
            "recommended" if d.best is v else "tied" if c.tied(conf) else "measured again")
        if conf.baseline and d.best is v:
            role += ", recommended"
        elif conf.baseline and c.tied(conf):
            role += ", tied"
        gain = c.gain(conf)
        passed = [p for r in c.full_rounds if (p := conf.bracket_rps(r)[0]) is not None]
        failed = [f for r in c.full_rounds if (f := conf.bracket_rps(r)[1]) is not None]
        rows.append({
            "config": role, "trial": f"#{conf.number}",
            "output tok/s": f"{iv.median:.1f}",
            "95% interval": _interval_text(iv.low, iv.high) if iv.known else "-",
            "gain": "-" if gain is None or not gain.n else f"{gain.median * 100:+.1f}%",
            "gain 95% interval": _interval_text(gain.low, gain.high, pct=True) if gain is not None and gain.known
            else "-",
            "rate req/s": f"{median(passed):.2f}" if passed else "-",
            "failed at req/s": f"{median(failed):.2f}" if failed else "-",
            "in the search tok/s": f"{v.ranked.output_throughput_tok_s:.1f}" if v.ranked.answerable else "misses",
        })
    return rows


def confirmation_lines(d: Decision) -> list[str]:
    """The confirmation's title, then its verdict in sentences: the gain with its interval, and what is tied."""
    c = d.confirmation
    assert c is not None and d.best is not None
    rounds = len(c.full_rounds)
    done = f"{rounds} rounds" if rounds == c.rounds else f"{rounds} of {c.rounds} planned rounds"
    out = [f"TTFT P99 limit {format_ms(d.limit_ms)}; confirmed in {done}, alternating, each config on a fresh engine, "
           f"its rate at the limit found by probes sized by evidence: median throughput, 95% interval of the mean "
           f"(Student t)"]
    best = d.confirmed_of(d.best)
    base = c.base
    if base is None:
        out.append("vLLM's defaults were not measured again (they did not run): no gain to confirm")
    elif best is base:
        others = [x for x in c.configs if x is not base]
        shown = ", ".join(f"#{x.number} {g.median * 100:+.1f}%" + (f" {_interval_text(g.low, g.high, True)}"
                                                                   if g.known else "")
                          for x in others if (g := c.gain(x)) is not None and g.n)
        out.append(f"vLLM's defaults ({d.defaults_of}) measured best in the confirmation: keep them"
                   + (f" (measured again against them: {shown})" if shown else ""))
    else:
        gain = c.gain(best)
        assert gain is not None
        if not gain.known:
            out.append(f"gain over vLLM's defaults ({d.defaults_of}): {gain.median * 100:+.1f}% output throughput, "
                       f"from {gain.n} round: no interval (--confirm 2 or more gives one)")
        elif gain.low > 0:
            out.append(f"gain over vLLM's defaults ({d.defaults_of}): {gain.median * 100:+.1f}% output throughput, "
                       f"95% interval {_interval_text(gain.low, gain.high, True)} over {gain.n} rounds: confirmed")
        else:
            out.append(f"gain over vLLM's defaults ({d.defaults_of}): {gain.median * 100:+.1f}% output throughput, "
                       f"95% interval {_interval_text(gain.low, gain.high, True)} over {gain.n} rounds: tied with "
                       f"vLLM's defaults (the interval includes no gain): deploy either; the defaults are the "
                       f"simpler choice, the recommendation the better bet")
    tied = [x for x in c.configs if c.tied(x) and not x.baseline]
    if tied:
        out.append("tied with the recommendation (the rounds do not rank them apart): "
                   + ", ".join(f"#{x.number} ({c.interval(x).median:.1f} tok/s)" for x in tied)
                   + "; optimize verify picks the most robust of them")
    if not c.complete:
        out.append(f"note: the confirmation is incomplete ({c.runs_done} of {c.rounds * len(c.configs)} runs): run "
                   f"the same command again to finish it")
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
    return (f"study {d.study_name!r}: feasible Pareto front of output throughput vs TTFT P99, "
            f"TTFT P99 <= {format_ms(d.limit_ms)} ({how})")


def curve_rows(d: Decision, v: TrialView) -> list[dict[str, Any]]:
    """A trial's stored replays in the order they ran: its latency-vs-load curve, judged under the limit."""
    keys = ("offered_rate_rps", "sent_rate_rps", "achieved_rate_rps", "output_throughput_tok_s",
            "request_throughput_rps", "ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms", "itl_p99_ms", "e2e_p99_ms",
            "completed", "failed", "sustained")
    engine_keys = ("running_peak", "queued_p99_ms", "prefill_p99_ms", "kv_usage_peak", "preemptions")
    with_engine = any(p.get("engine") for p in v.curve)  # the engine's own view, where the engine reports it
    return [{"replay": i, "arrivals": "burst" if p.get("offered_rate_rps") is None else d.arrivals,
             **{k: p.get(k) for k in keys}, "meets_limit": qualifies(p, d.limit_ms, d.other_limits_ms),
             "chosen": v.ranked.point is not None  # every replay at the chosen rate (repeats are merged)
             and p.get("offered_rate_rps") == v.ranked.point.get("offered_rate_rps"),
             **({f"engine_{k}": (p.get("engine") or {}).get(k) for k in engine_keys} if with_engine else {})}
            for i, p in enumerate(v.curve)]


def trial_notes(v: TrialView) -> list[str]:
    """Under a trial's curve: what limited it at its chosen point (engine stats) and its GPU telemetry."""
    from optimizer.measurement.limits import diagnose

    out = []
    point = v.ranked.point
    found = diagnose(point.get("engine"), point.get("ttft_p99_ms")) if point else None
    line = found.line if found else LIMITED_BY.of(v.trial)
    if line:
        out.append(line)
    tele = TELEMETRY.of(v.trial)
    if tele and tele.get("available"):
        out.append(f"GPU {tele.get('device')}: utilization mean {tele.get('utilization_mean_pct')}% max "
                   f"{tele.get('utilization_max_pct')}%, memory used max {tele.get('memory_used_max_gib')} GiB "
                   f"({tele.get('samples')} samples)")
    elif tele:
        out.append(f"GPU telemetry: none ({tele.get('reason')})")
    return out


def confirmation_run_lines(d: Decision, v: TrialView) -> list[str]:
    """Under a trial's curve: its confirmation runs, a line each (none where it was not measured again)."""
    from optimizer.search.confirm import describe

    mine = d.confirmed_of(v)
    if mine is None:
        return []
    return [describe(mine.runs[r]) for r in sorted(mine.runs)]


def render(d: Decision, fmt: str) -> tuple[str, list[str]]:
    """What `optimize report` prints: (stdout, lines for stderr). Machine formats keep stdout to the rows."""
    check_format(fmt)
    if fmt != "table":
        return format_output(front_rows(d), fmt), [title(d), *summary_lines(d)]
    parts = [title(d), format_output(front_rows(d, with_params=False), "table") if d.front else "(no trial)"]
    if d.front:
        parts += ["", format_output(params_rows(d), "table")]
    if d.confirmed:
        parts += ["", confirmation_lines(d)[0], format_output(confirmation_rows(d), "table")]
    return "\n".join([*parts, "", *summary_lines(d)]), []


def role_text(d: Decision, v: TrialView) -> str:
    """`v`'s role in the decision in words: 'recommended', 'baseline', 'tied', joined; '' for none."""
    return _role(d, v, frozenset(x.number for x in d.ties))


def limited_line(v: TrialView) -> str | None:
    """What limited `v` at its chosen point (its engine's stats, or the line its trial stored), None where unknown."""
    from optimizer.measurement.limits import diagnose

    point = v.ranked.point
    found = diagnose(point.get("engine"), point.get("ttft_p99_ms")) if point else None
    return found.line if found else LIMITED_BY.of(v.trial)
