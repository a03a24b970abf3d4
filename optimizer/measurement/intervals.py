"""Pure: 95% confidence intervals for a few repeated measurements, and when two of them are tied.

The confirmation (optimizer/search/confirm.py) measures each config again in N rounds. A config's number is the
median of its rounds; its interval is Student's t interval of their mean,

    mean +- t(0.975, n - 1) * s / sqrt(n)

which is honest with as few as 2 values (wide: with 3 rounds t is 4.30). The gain of one config over another is
measured per round, as the ratio of the two measurements taken next to each other (the rounds alternate, so a
slow minute of a shared machine hits both). Every config of the confirmation is measured once in every round, so
the rounds are blocks of a randomized complete block design: `block_gain_interval` fits log throughput as config +
round over all of them and gives the gain's interval from the residual spread of every config, with (C - 1)(R - 1)
degrees of freedom instead of the R - 1 of one pair's ratios (`gain_interval`): with 3 configs and 3 rounds, 4
instead of 2, which at the confirmation's 97.5% is a t of 3.50 instead of 6.21. A config that dropped out of the
later rounds keeps its rounds before in that fit (least squares over the runs there are, `additive_residual`). The
gain a report shows beside two medians is their ratio (`relative_gain`), so that it follows from the numbers next to
it and ranks the configs as their medians do; the per-round interval says how sure that ranking is.

Where the next run of a config will land is another question than where the mean of its runs lies: a rate to
provision for is the one-sided lower prediction bound of one more run (`lower_prediction_factor`), from the spread
of every config's runs around its own mean.

A claim check that measures the gain again (benchmarks/confirm_claim.py) compares a noisy re-measurement with the
interval: `chance_inside` says how often an interval right about its spread holds it.

Two configs are *tied* when the interval of their per-round gain includes 0: no ranking of them is backed by the
measurements. A single measurement's bracket (the rate passed to the rate failed) is its interval before a
confirmation: two trials whose brackets overlap are tied.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from optimizer.measurement.noise import median

# Student's t, two-sided 95% (0.975 quantile), by degrees of freedom; past 30 the normal 1.96 is close enough.
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
         29: 2.045, 30: 2.042}
Z_975 = 1.96


def t_975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (df >= 1)."""
    if df < 1:
        raise ValueError("Student's t needs at least one degree of freedom (two values)")
    return T_975.get(df, Z_975)


def t_within(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with `df` (an integer >= 1) degrees of freedom, by its closed form (the finite
    series in cos(theta), theta = atan(t / sqrt(df)); Abramowitz & Stegun 26.7.3-4)."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    term, total = 1.0, 1.0
    if df % 2:  # odd: 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        series = math.sin(theta) * math.cos(theta) * total if df > 1 else 0.0
        return 2 / math.pi * (theta + series)
    for k in range(1, df // 2):  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
        term *= c2 * (2 * k - 1) / (2 * k)
        total += term
    return math.sin(theta) * total


def t_quantile(confidence: float, df: int) -> float:
    """The t with P(|T| <= t) = `confidence` (two-sided) for `df` >= 1 degrees of freedom: t_975(df) at 0.95, else
    by bisection on `t_within` (to 1e-6)."""
    if df < 1:
        raise ValueError("Student's t needs at least one degree of freedom (two values)")
    if confidence == 0.95:
        return t_975(df)
    low, high = 0.0, 1.0
    while t_within(high, df) < confidence:
        high *= 2
    while high - low > 1e-6:
        mid = (low + high) / 2
        low, high = (mid, high) if t_within(mid, df) < confidence else (low, mid)
    return (low + high) / 2


@dataclass(frozen=True)
class Interval:
    """A measured number: the median of `n` values and the 95% interval of their mean (NaN bounds below 2)."""

    median: float
    low: float
    high: float
    n: int

    @property
    def known(self) -> bool:
        """True when there is an interval at all (two values or more)."""
        return self.n >= 2 and math.isfinite(self.low) and math.isfinite(self.high)

    def overlaps(self, other: Interval) -> bool:
        """True when the two intervals share a value (either without an interval counts as its median alone)."""
        a_low, a_high = (self.low, self.high) if self.known else (self.median, self.median)
        b_low, b_high = (other.low, other.high) if other.known else (other.median, other.median)
        return a_low <= b_high and b_low <= a_high

    def contains(self, value: float) -> bool:
        return self.known and self.low <= value <= self.high

    def to_dict(self) -> dict[str, float | int | None]:
        return {"median": self.median, "low": self.low if self.known else None,
                "high": self.high if self.known else None, "n": self.n}


def interval(values: Sequence[float], floor: float = -math.inf, confidence: float = 0.95) -> Interval:
    """The median of `values` with the t interval of their mean at `confidence` (95% unless a correction for
    repeated looks asks for more), cut at `floor` (a throughput is never below 0, a gain never below -100%)."""
    n = len(values)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    if n == 1:
        return Interval(float(values[0]), math.nan, math.nan, 1)
    mean = sum(values) / n
    s = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(confidence, n - 1) * s / math.sqrt(n)
    return Interval(median(values), max(mean - half, floor), mean + half, n)


def gain_interval(pairs: Sequence[tuple[float, float]], confidence: float = 0.95) -> Interval:
    """The relative gain of `b` over `a` from measurements taken in pairs `(a, b)`: per pair b / a - 1, its median
    and the t interval of its mean at `confidence`. Pairs whose `a` is not positive cannot give a ratio and are left
    out."""
    return interval([b / a - 1 for a, b in pairs if a > 0], floor=-1.0, confidence=confidence)


def block_gain_interval(rows: Sequence[Sequence[float | None]], a: int, b: int, confidence: float = 0.95) -> Interval:
    """Row `b`'s relative gain over row `a`, each row one config measured once in each of the same rounds
    (`rows[i][r]`), so that a round is a block.

    The point is the median of the per-round gains b / a - 1, as `gain_interval`'s. The interval is
    exp(d +- t * sqrt(2 * MSE / R)) - 1: d the mean per-round log ratio of b to a, MSE the residual mean square of the
    additive fit log(value) = config + round over every row, t at `confidence` with (C - 1)(R - 1) degrees of
    freedom. The configs measured beside the two say how much a run moves once its round's shift is taken out; with
    two rows it is the t interval of their per-round log ratios. A row with a value that is not positive (a run that
    met the limit nowhere: no log) is left out of the fit; when it is `a` or `b`, their pairs alone decide
    (`gain_interval`). A row beside the two may miss rounds (None: a config that dropped out, not measured since):
    its rounds still count, the fit then by least squares over the values there are (`additive_residual`), on
    values - configs - rounds + 1 degrees of freedom."""
    rounds = len(rows[a])
    fitted = _fitted_rows(rows, a, b)
    if fitted is None:
        return gain_interval(list(zip(rows[a], rows[b])), confidence=confidence)
    logs = {i: [None if v is None else math.log(v) for v in rows[i]] for i in fitted}
    sse, df = additive_residual(list(logs.values()))
    half = t_quantile(confidence, df) * math.sqrt(2 * sse / df / rounds)
    d = sum(y - x for x, y in zip(logs[a], logs[b])) / rounds
    gains = [y / x - 1 for x, y in zip(rows[a], rows[b])]
    # an early look's t is in the thousands (99.98% on 1 degree of freedom): keep its bound finite, not an overflow
    return Interval(median(gains), math.exp(max(d - half, -700.0)) - 1, math.exp(min(d + half, 700.0)) - 1, rounds)


def block_gain_df(rows: Sequence[Sequence[float | None]], a: int, b: int) -> int:
    """The degrees of freedom of `block_gain_interval(rows, a, b)`'s t: its additive fit's (values less configs less
    rounds plus one), or the pair's usable rounds less one where their pairs alone decide (`gain_interval`)."""
    fitted = _fitted_rows(rows, a, b)
    if fitted is None:
        return sum(x > 0 for x in rows[a]) - 1
    present = sum(v is not None for i in fitted for v in rows[i])
    return present - len(fitted) - len(rows[a]) + 1


def _fitted_rows(rows: Sequence[Sequence[float | None]], a: int, b: int) -> list[int] | None:
    """The rows `block_gain_interval` fits (every value positive, two or more of them), or None when `a` or `b` is
    not among them or there are fewer than 2 rounds: their pairs alone decide then."""
    rounds = len(rows[a])
    if any(len(row) != rounds for row in rows):
        raise ValueError("every row needs one value per round")
    if None in rows[a] or None in rows[b]:
        raise ValueError("the two rows compared need a value in every round")
    fitted = [i for i, row in enumerate(rows) if all(v > 0 for v in row if v is not None)
              and sum(v is not None for v in row) >= 2]
    return fitted if a in fitted and b in fitted and rounds >= 2 else None


def additive_residual(rows: Sequence[Sequence[float | None]], sweeps: int = 1000,
                      tolerance: float = 1e-12) -> tuple[float, int]:
    """Pure: the residual sum of squares of the additive fit value = row + column, by least squares over the values
    present (None: missing), and its degrees of freedom: values less rows less columns plus one. A full table is
    the two-way formula; one with holes is fitted by alternating means (Gauss-Seidel on the normal equations, which
    converges for a table whose rows are linked by shared columns, as rounds are by the configs measured in all)."""
    columns = len(rows[0])
    present = [(i, r, v) for i, row in enumerate(rows) for r, v in enumerate(row) if v is not None]
    if len(present) == len(rows) * columns:
        row_mean = [sum(row) / columns for row in rows]
        column_mean = [sum(row[r] for row in rows) / len(rows) for r in range(columns)]
        grand = sum(column_mean) / columns
        sse = sum((v - row_mean[i] - column_mean[r] + grand) ** 2 for i, r, v in present)
    else:
        row_fx, column_fx = [0.0] * len(rows), [0.0] * columns
        for _ in range(sweeps):
            moved = 0.0
            for i, row in enumerate(rows):
                cells = [(v - column_fx[r]) for r, v in enumerate(row) if v is not None]
                new = sum(cells) / len(cells)
                moved, row_fx[i] = max(moved, abs(new - row_fx[i])), new
            for r in range(columns):
                cells = [(row[r] - row_fx[i]) for i, row in enumerate(rows) if row[r] is not None]
                new = sum(cells) / len(cells)
                moved, column_fx[r] = max(moved, abs(new - column_fx[r])), new
            if moved < tolerance:
                break
        sse = sum((v - row_fx[i] - column_fx[r]) ** 2 for i, r, v in present)
    return sse, len(present) - len(rows) - columns + 1


# The variance of the median of m independent standard normal values, m = 1 to 20 (from 2 million draws each; the
# median of two is their mean, exactly 1/2); past 20, pi / (2 m), its limit, at most 7% over.
MEDIAN_VARIANCE = (1.0, 0.5, 0.449, 0.298, 0.287, 0.215, 0.211, 0.168, 0.166, 0.138, 0.137, 0.118, 0.117, 0.102,
                   0.101, 0.090, 0.090, 0.081, 0.081, 0.073)


def median_variance(m: int) -> float:
    """The variance of the median of `m` >= 1 independent standard normal values."""
    if m < 1:
        raise ValueError("a median needs at least one value")
    return MEDIAN_VARIANCE[m - 1] if m <= len(MEDIAN_VARIANCE) else math.pi / (2 * m)


def chance_inside(t: float, df: int, rounds: int, again: int) -> float:
    """Pure: how often an interval that is right about its spread holds a re-measurement's median. The interval is
    mean +- t * s / sqrt(`rounds`) over `rounds` paired rounds (s: the spread of one round's gain, estimated on `df`
    degrees of freedom, as `block_gain_interval`'s and `gain_interval`'s are); the re-measurement is the median
    gain of `again` more rounds measured alike. Their difference has the variance s^2 (1 / rounds +
    median_variance(again)), so the chance is P(|T_df| <= t / sqrt(1 + rounds * median_variance(again))).

    A claim check re-measures the gain and asks whether the reported interval holds it, and the re-measurement has
    noise of its own: 8 rounds' interval at t = 2.5 on 14 degrees of freedom holds a 3-round median 74% of the time
    when nothing is wrong with it, a 6-round median 85%, a 16-round one 92% (the interval itself holds the true gain
    97.5% of the time: that t is its confidence)."""
    if rounds < 1 or again < 1 or df < 1:
        raise ValueError("the chance needs rounds, a re-measurement and a degree of freedom")
    return t_within(t / math.sqrt(1 + rounds * median_variance(again)), df)


def lower_prediction_factor(rows: Sequence[Sequence[float]], runs: int, coverage: float = 0.95) -> float | None:
    """How far under its measured level one more run of a config may land: exp(-t * s * sqrt(1 + 1 / runs)), the
    one-sided `coverage` lower prediction bound of one more log-normal value, as a factor of the geometric mean of
    the `runs` values measured of it.

    Each row is one config's values, one per run (its rate at the limit in each confirmation round); s is the spread
    of log(value) around each row's own mean, pooled over the rows on sum(n_i - 1) degrees of freedom, and t is
    Student's one-sided `coverage` quantile on them. That spread holds everything that moves a run from one round to
    the next (the machine's minute, the draw, the fit), which is what a run after the study meets too. Rows with a
    value that is not positive and finite (a run that met the limit nowhere, a burst) are left out; None when no
    degree of freedom remains."""
    kept = [[math.log(v) for v in row] for row in rows if row and all(0 < v < math.inf for v in row)]
    df = sum(len(row) - 1 for row in kept)
    if df < 1 or runs < 1:
        return None
    sse = sum((v - sum(row) / len(row)) ** 2 for row in kept for v in row)
    return math.exp(-t_quantile(2 * coverage - 1, df) * math.sqrt(sse / df) * math.sqrt(1 + 1 / runs))


def geometric_mean(values: Sequence[float]) -> float:
    """exp(mean(log(values))) of positive values (NaN when there are none, or one is not positive)."""
    if not values or any(not v > 0 for v in values):
        return math.nan
    return math.exp(sum(math.log(v) for v in values) / len(values))


def relative_gain(base: float, other: float) -> float:
    """`other`'s relative gain over `base`: other / base - 1 (NaN when `base` is not positive or either is NaN)."""
    if not base > 0 or math.isnan(other):
        return math.nan
    return other / base - 1


def rate_bracket_tok_s(throughput_tok_s: float, passed_rps: float | None, failed_rps: float | None,
                       noise: float = 0.0) -> tuple[float, float]:
    """Pure: where a single measurement's true throughput at the limit may lie. The rate search passed at
    `passed_rps` and failed at `failed_rps` (None: nothing above it was tried), so throughput lies between the
    passed point's and that times failed / passed; `noise` (a fraction, e.g. 2 x the study's CV) widens both ends."""
    low = throughput_tok_s * (1 - noise)
    ratio = failed_rps / passed_rps if passed_rps and failed_rps and failed_rps > passed_rps else 1.0
    return low, throughput_tok_s * ratio * (1 + noise)


def brackets_overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]
