"""The rate at the limit in process and as served, side by side: each config the confirmation ran through `vllm serve`
(search/confirm.py) beside its rounds in process, each number named by how it was measured, and where the two differ
by more than their intervals."""

from __future__ import annotations

import math
from typing import Any

from optimizer.decision.decide import Decision
from optimizer.measurement.intervals import geometric_mean, lower_prediction_factor
from optimizer.search.attrs import PRUNED_REASON
from optimizer.search.measured import measurement_of
from optimizer.search.missed import why_infeasible
from optimizer.search.confirmed import Confirmation, Confirmed
from optimizer.search.study import run_name

IN_PROCESS = "in process (AsyncLLM)"
AS_SERVED = "as served (vllm serve over HTTP)"
PROVISION_COVERAGE = 0.95
PROVISION_STATISTIC = ("one-sided 95% lower prediction bound of one more run on this machine, from the spread of the "
                       "rounds' rates in process (log scale, pooled over every config of the rounds)")


def provision_rps(c: Confirmation, conf: Confirmed, served: bool = False) -> float | None:
    """The rate to provision `conf` for: where one more run of it on this machine still holds the limit 19 times in
    20 (`lower_prediction_factor` over every config's rates in process, round by round), under the geometric mean of
    its rounds in process, or (`served`) under its one run as served, which the rounds' spread is applied to. None
    when there is no spread to go by (fewer than two rounds), or no rate to start from (a round, or the run as
    served, met the limit nowhere)."""
    rows = [[v for r in c.full_rounds if (v := x.rate_rps(r)) is not None] for x in c.configs]
    if served:
        fit = conf.served_rate
        level, runs = (fit.rate_rps if fit is not None else math.nan), 1
    else:
        own = rows[c.configs.index(conf)]
        level, runs = (geometric_mean(own) if all(math.isfinite(v) for v in own) else math.nan), len(own)
    factor = lower_prediction_factor(rows, runs, PROVISION_COVERAGE)
    return None if factor is None or not (math.isfinite(level) and level > 0) else level * factor


def served_record(c: Confirmation, conf: Confirmed) -> dict[str, Any]:
    """`conf`'s rate at the limit in process (the median of its full rounds, the interval of their mean) and as
    served (`vllm serve` over HTTP, its run's pooled fit and 95% interval; None: not served), each named, and whether
    they differ by more than both intervals (`differ`)."""
    rates = c.rate_interval(conf)
    served = conf.served_rate
    inproc = (rates.low, rates.high) if rates.known else None
    differ = None
    if served is not None and rates.n:
        low, high = inproc or (rates.median, rates.median)
        differ = not (served.low_rps <= high and low <= served.high_rps)
    why = None
    if conf.served is not None and served is None:
        m = measurement_of(conf.served)
        why = PRUNED_REASON.of(conf.served) or (why_infeasible(m) if m is not None and conf.served.state.name ==
                                                "COMPLETE" else conf.served.state.name)
    return {"rate_at_limit_rps": rates.median if rates.n else None,
            "rate_low_rps": inproc[0] if inproc else None, "rate_high_rps": inproc[1] if inproc else None,
            "rate_measured_as": IN_PROCESS,
            "served_rate_at_limit_rps": served.rate_rps if served is not None else None,
            "served_low_rps": served.low_rps if served is not None else None,
            "served_high_rps": served.high_rps if served is not None and math.isfinite(served.high_rps) else None,
            "served_measured_as": AS_SERVED if conf.served is not None else None,
            "served_run": run_name(conf.served) if conf.served is not None else None,
            "served_not_measured": why, "served_differs": differ,
            "provision_rps": provision_rps(c, conf),
            "served_provision_rps": provision_rps(c, conf, served=True) if served is not None else None,
            "provision_statistic": PROVISION_STATISTIC}


def rate_interval_text(low_rps: float, high_rps: float | None) -> str:
    """'[50.30, 53.80]'; '[50.30, open]' for a lower bound."""
    return f"[{low_rps:.2f}, {'open' if high_rps is None else format(high_rps, '.2f')}]"


def served_cell(r: dict[str, Any]) -> str:
    """A `served_record`'s rate as served with its interval, for a table; where the run through `vllm serve` found
    none, "not measured" and its run (`served_lines` says why); "-" where the config was not served."""
    if r["served_rate_at_limit_rps"] is not None:
        return f"{r['served_rate_at_limit_rps']:.2f} {rate_interval_text(r['served_low_rps'], r['served_high_rps'])}"
    return f"not measured ({r['served_run']})" if r["served_run"] else "-"


def served_lines(d: Decision) -> list[str]:
    """What the runs through `vllm serve` found, one line per config served: its rate at the limit as served beside
    the rate in process, and, where the two differ by more than their intervals, that they do."""
    c = d.confirmation
    if c is None:
        return []
    records = [(conf, served_record(c, conf)) for conf in c.configs if conf.served is not None]
    out = []
    for conf, r in records:
        who = f"#{conf.number}" + (f" vLLM's defaults ({d.defaults_of})" if conf.baseline else "")
        inproc = (f"{r['rate_at_limit_rps']:.2f} req/s in process" if r["rate_at_limit_rps"] is not None
                  else "no rate in process")
        if r["rate_low_rps"] is not None:
            inproc += f" {rate_interval_text(r['rate_low_rps'], r['rate_high_rps'])}"
        if r["served_rate_at_limit_rps"] is None:
            out.append(f"as served (vllm serve over HTTP, run {r['served_run']}): {who} not measured "
                       f"({r['served_not_measured']}); {inproc}")
            continue
        line = (f"as served (vllm serve over HTTP, run {r['served_run']}): {who} holds the limits up to "
                f"{r['served_rate_at_limit_rps']:.2f} req/s "
                f"{rate_interval_text(r['served_low_rps'], r['served_high_rps'])}; {inproc}")
        if r["served_differs"] and r["rate_at_limit_rps"]:
            pct = (r["served_rate_at_limit_rps"] / r["rate_at_limit_rps"] - 1) * 100
            line += f": they differ by more than their intervals ({pct:+.0f}% as served); deploy for the served rate"
        out.append(line)
    base = next((r for conf, r in records if conf.baseline), None)
    others = [(conf, r) for conf, r in records if not conf.baseline] if base is not None else []
    out += [line for conf, r in others if (line := order_as_served_line(conf.number, r, base, d.defaults_of))]
    return out + provision_lines(records)


EVEN_BELOW = 0.0005  # a ratio this close to 1 prints as -0.0% or +0.0%: its sign says nothing


def signed_pct(x: float) -> str:
    """'+12.3%', '-0.3%'; 'even' where a tenth of a percent does not tell the sign ('-0.0%' says nothing)."""
    return f"{x:+.1%}" if abs(x) >= EVEN_BELOW else "even to a tenth of a percent"


def order_as_served_line(number: int, leader: dict[str, Any], base: dict[str, Any], defaults_of: str) -> str | None:
    """Pure: where the runs through `vllm serve` rank config #`number` and vLLM's defaults the other way round from
    their rounds in process (each a `served_record`), a line that says so: the confirmation's gain is measured in
    process, and one run each as served does not rank them: not where their intervals overlap, nor where they do not,
    since a run's interval covers its own requests and minutes, not the next run's (a pair -25% apart as served,
    beyond their intervals, read -3%, -5% and +72% in 3 more rounds of benchmarks/served_order.py, each config's rate
    as served moving between 0.57 and 0.96 of its rate in process). None where the two
    orders agree, or either lacks a rate (or a rate of 0: a config that met the limit in none of its rounds)."""
    rates = (leader["rate_at_limit_rps"], base["rate_at_limit_rps"],
             leader["served_rate_at_limit_rps"], base["served_rate_at_limit_rps"])
    if any(v is None or not v > 0 for v in rates):
        return None
    inproc, served = rates[0] / rates[1] - 1, rates[2] / rates[3] - 1
    if inproc * served >= 0:
        return None
    high = [math.inf if v["served_high_rps"] is None else v["served_high_rps"] for v in (leader, base)]
    apart = leader["served_low_rps"] > high[1] or base["served_low_rps"] > high[0]
    how = ("apart beyond their 95% intervals, which hold one run, not the next: these runs alone do not rank them"
           if apart else "their 95% intervals overlap, so these runs alone do not rank them")
    head = "the order is the other way round" if abs(served) >= EVEN_BELOW else "they are even"
    return (f"as served {head}: #{number} held {rates[2]:.2f} req/s, vLLM's defaults ({defaults_of}) "
            f"{rates[3]:.2f} ({signed_pct(served)}; in process {signed_pct(inproc)}; one run each, {how}): the "
            f"gain above is measured in process; before deploying for it behind `vllm serve`, measure both as served "
            f"again (`optimize --backend http` in a new study, or `optimize measure` against each deployment)")


def provision_lines(records: list[tuple[Confirmed, dict[str, Any]]]) -> list[str]:
    """The rates to provision the configs served for (`provision_rps`, from their `served_record`s), in one line,
    each named by its backend: a rate at the limit is where these engines held it in the minutes measured; one more
    run on a shared machine meets other minutes."""
    parts = []
    for conf, r in records:
        rates = [f"{r['served_provision_rps']:.2f} req/s as served"] if r["served_provision_rps"] is not None else []
        rates += [f"{r['provision_rps']:.2f} in process"] if r["provision_rps"] is not None else []
        if rates:
            parts.append(f"#{conf.number}" + (" vLLM's defaults" if conf.baseline else "") + f" {', '.join(rates)}")
    if not parts:
        return []
    return ["provision for (one more run on this machine holds the limits there 19 times in 20, by the spread of the "
            f"rounds' rates): {'; '.join(parts)}"]
