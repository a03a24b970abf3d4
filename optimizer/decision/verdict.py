"""The decision in words: `answer_line`, the one short line that leads the last screen and the report, and
`verdict_line`, the confirmation's verdict in a sentence: which of the three outcomes the rounds reached, and how many
rounds are behind it."""

from __future__ import annotations

from typing import Any

from optuna.trial import TrialState

from optimizer.decision.decide import Decision, view
from optimizer.decision.numbers import Gain
from optimizer.measurement.sequential import PRECISE_HALF_WIDTH, Outcome


def verdict_line(d: Decision) -> str:
    """The confirmation's verdict in one sentence, one of three (measurement/sequential.py): better than vLLM's
    defaults by X% [a, b]; within +-Y% of them (or behind them), keep them; or undecided, with the interval. Each
    says how many rounds are behind it; a confirmation cut short (a deadline, Ctrl-C) says how far it got. The gain
    shown is the ratio of the medians, its interval the per-round one (`decision/numbers.py`), the one the rounds
    stopped on."""
    c = d.confirmation
    assert c is not None and d.best is not None
    rounds = len(c.full_rounds)
    n = f"{rounds} round{'s' if rounds != 1 else ''}"
    base, best = c.base, d.confirmed_of(d.best)
    if base is None:
        missed = d.baseline is not None and d.baseline.trial.state == TrialState.COMPLETE \
            and not d.baseline.ranked.answerable  # ran to its end, and no rate met the limit (not: its engine died)
        why = "they met the limit at no rate the search tried" if missed else "they did not run"
        return f"vLLM's defaults were not measured again ({why}): no gain to confirm ({n})"
    compared, gains = _compared(d)
    shown = _shown(gains)
    against = f"vLLM's defaults ({d.defaults_of})"
    if c.outcome == Outcome.BETTER and gains:
        g = gains[0][1]
        return (f"better than {against} by {g.pct:+.1f}% output throughput"
                + (f" {g.interval_text()}" if g.known else "") + f", {n}: deploy the recommendation")
    if c.outcome == Outcome.KEEP:
        if not compared:  # the search found no other config that met the limit: nothing to compare them with
            return f"{against} are the only config measured again (no other met the limit), {n}: keep them"
        known = [g for _, g in gains if g.known and g.low_pct is not None and g.high_pct is not None]
        if known and all(g.high_pct < 0 for g in known):
            return f"{against} are better than every candidate ({shown}), {n}: keep them"
        # the width is the tied ones': a candidate wholly behind the defaults is said to be, not folded into it
        behind = [(x, g) for x, g in gains if g.known and g.high_pct < 0]
        tied = [(x, g) for x, g in gains if (x, g) not in behind]
        y = max((max(abs(g.low_pct), abs(g.high_pct)) for _, g in tied if g.known), default=0.0)
        return (f"within +-{y:.1f}% of {against} ({_shown(tied)})"
                + (f", behind them: {_shown(behind)}" if behind else "") + f", {n}: keep them")
    if c.outcome == Outcome.UNDECIDED:
        choice = ("keep the defaults" if best is base or best is None else
                  f"deploy either: the defaults are the simpler choice, #{best.number} the better bet")
        return (f"undecided after {n}: {shown or 'no interval'} against {against}: {choice} "
                f"({d.more_rounds_advice})")
    if gains and best is not None and best is not base and gains[0][1].known and (gains[0][1].low_pct or 0.0) > 0:
        g = gains[0][1]  # cut short (a deadline, Ctrl-C) above 0 but wider than the rounds stop at
        return (f"better so far than {against} by {g.pct:+.1f}% output throughput {g.interval_text()} after {n}, "
                f"not yet within +-{PRECISE_HALF_WIDTH * 100:g} points: run the same command again to go on")
    return f"not decided yet after {n} ({shown or 'no interval'}): run the same command again to go on"


def _compared(d: Decision) -> tuple[list, list[tuple[Any, Gain]]]:
    """The confirmed configs the verdict weighs against vLLM's defaults (the recommendation, or where the defaults
    are recommended, every candidate still measured) and those of them with a gain, as (config, Gain)."""
    c = d.confirmation
    assert c is not None and d.best is not None
    base, best = c.base, d.confirmed_of(d.best)
    compared = [best] if best is not None and best is not base else [x for x in c.active if x is not base]
    return compared, [(x, g) for x in compared if (g := d.gain(view(d, x.number))) is not None]


def answer_line(d: Decision) -> str:
    """The decision in one short line, the first of the last screen and of `optimize report`: what to deploy, its gain
    over vLLM's defaults with the 95% interval the rounds stopped on (or, not confirmed, the search's one
    measurement each, which has none), and the rounds behind it. The sentences of `verdict_line` and the report say
    the rest."""
    if d.best is None:
        return f"decision: nothing to deploy: no config met {d.limits.text}"
    if not d.confirmed:
        if d.best is d.baseline:
            return "decision: keep vLLM's defaults: no trial beat them (one measurement each, not confirmed)"
        g = d.gain(d.best)
        if g is None or d.baseline is None:
            return (f"decision: deploy #{d.best.number}: vLLM's defaults met the limit at no rate tried "
                    f"(not confirmed)")
        noise = "" if d.beyond_noise(d.best, d.baseline) else ", within noise"
        return (f"decision: deploy #{d.best.number}: {g.pct:+.1f}% output tok/s over vLLM's defaults "
                f"(one measurement each{noise}, not confirmed)")
    c = d.confirmation
    assert c is not None
    rounds = len(c.full_rounds)
    n = f"{rounds} round{'s' if rounds != 1 else ''}"
    if c.base is None:
        tp = d.throughput(d.best)
        interval = f" [{tp.low_tok_s:.1f}, {tp.high_tok_s:.1f}]" if tp.low_tok_s is not None \
            and tp.high_tok_s is not None else ""
        return (f"decision: deploy #{d.best.number}: {tp.output_throughput_tok_s:.1f} output tok/s{interval} "
                f"({n}); vLLM's defaults were not measured again")
    compared, gains = _compared(d)

    def one(x: Any, g: Gain) -> str:
        return f"#{x.number} {g.pct:+.1f}%" + (f" {g.interval_text()}" if g.known else " (no interval)")

    closest = max(gains, key=lambda xg: xg[1].pct, default=None)
    if c.outcome == Outcome.BETTER and gains:
        x, g = gains[0]
        interval = f" {g.interval_text()}" if g.known else ""
        return f"decision: deploy #{x.number}: {g.pct:+.1f}% output tok/s over vLLM's defaults{interval} ({n})"
    if c.outcome == Outcome.KEEP:
        if not compared:
            return f"decision: keep vLLM's defaults: no other config met the limit ({n})"
        rival = f": the closest rival is {one(*closest)}" if closest is not None else ""
        return f"decision: keep vLLM's defaults{rival} ({n})"
    shown = one(*closest) if closest is not None else "no interval"
    if c.outcome == Outcome.UNDECIDED:
        choice = "keep them" if d.best is d.baseline else "deploy either"
        return f"decision: undecided after {n}: {shown} against vLLM's defaults; {choice}, or add rounds"
    return f"decision: not decided yet after {n}: {shown} against vLLM's defaults; run the same command again"


def _shown(gains: list) -> str:
    """'#11 +0.5% [-1.0%, +1.8%], #7 -9.9% [-11.5%, -9.0%]': each (config, Gain) with its interval where known."""
    return ", ".join(f"#{x.number} {g.pct:+.1f}%" + (f" {g.interval_text()}" if g.known else "") for x, g in gains)
