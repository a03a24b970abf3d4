"""Pure: how well a replay's requests pin down TTFT P99, and how many requests would pin it down.

The P99 of n samples is close to their maximum for n ~ 100: one slow request decides it. How close the estimate
is to the true 99th percentile follows from order statistics alone, with no assumption on the latency
distribution: the number of samples below the true quantile is Binomial(n, 0.99), so the sorted samples
x(l) <= x(u) whose ranks bracket that count with probability >= 1 - alpha are a confidence interval
(Hahn & Meeker, "Statistical Intervals", ch. 5). Its upper end exists only when n is large enough for the
maximum to lie above the true P99 with probability >= 1 - alpha/2: n >= ln(alpha/2) / ln(0.99), 367 requests
at 95%. Below that, no replay length can vouch for the P99 from above, whatever the engine.

How many requests a stable estimate needs depends on the tail: `requests_needed` fits an exponential tail to
the samples' top decile (peaks over a threshold with shape 0: queueing delays have exponential tails) and finds
the smallest n whose interval, predicted on that tail, is within `tolerance` of the estimate.

That interval counts every request as an independent draw. In a queue they are not: a burst of arrivals delays
the requests behind it together, so neighbours' TTFTs are correlated and n requests carry the information of
fewer. `effective_fraction` measures it from a replay's TTFTs in send order, as for an AR(1) series: n_eff / n =
(1 - rho) / (1 + rho), rho the lag-1 autocorrelation; `requests_needed(..., fraction)` asks for n / fraction. On
the simulator at the demo's knee (rho ~0.5), the P99's spread across 30 workload seeds is 14% of it at 368
requests, where the independent-draw interval promises ~10%; 8% at 1000 and 5% at 3000.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

P99 = 0.99
MAX_REQUESTS = 100_000


def _binom_cdf_table(n: int, p: float) -> list[float]:
    """F(k) = P(Binomial(n, p) <= k) for k = 0..n, computed in log space (stable for large n)."""
    logs = [math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p)
            + (n - k) * math.log1p(-p) for k in range(n + 1)]
    top = max(logs)
    pmf = [math.exp(v - top) for v in logs]
    total = sum(pmf)
    out, acc = [], 0.0
    for v in pmf:
        acc += v / total
        out.append(min(acc, 1.0))
    return out


def quantile_ci_ranks(n: int, q: float = P99, confidence: float = 0.95) -> tuple[int, int | None]:
    """1-based ranks (l, u) of the sorted samples that bracket the q-quantile with probability >= `confidence`.

    Equal tails: P(count below the quantile < l) <= alpha/2 and P(count >= u) <= alpha/2. `l` is 0 when no sample
    is low enough (the interval is open below) and `u` is None when no sample is high enough (open above).
    """
    if n < 1:
        raise ValueError("need at least one sample")
    alpha = 1.0 - confidence
    cdf = _binom_cdf_table(n, q)  # count of samples <= the true quantile ~ Binomial(n, q)
    # lower: the largest l with P(K <= l - 1) <= alpha/2, i.e. x(l) is below the quantile with prob >= 1 - alpha/2
    low = 0
    for rank in range(1, n + 1):
        if cdf[rank - 1] <= alpha / 2:
            low = rank
        else:
            break
    # upper: the smallest u with P(K <= u - 1) >= 1 - alpha/2
    high = next((rank for rank in range(1, n + 1) if cdf[rank - 1] >= 1 - alpha / 2), None)
    return low, high


def min_requests_for_upper_bound(q: float = P99, confidence: float = 0.95) -> int:
    """The fewest samples whose maximum lies above the true q-quantile with probability >= 1 - alpha/2."""
    alpha = 1.0 - confidence
    return math.ceil(math.log(alpha / 2) / math.log(q))


def lag1_autocorrelation(x: Sequence[float]) -> float:
    """Sample autocorrelation at lag 1 (0 for fewer than 3 samples or a constant series)."""
    a = np.asarray(x, dtype=float)
    if len(a) < 3:
        return 0.0
    d = a - a.mean()
    denom = float(np.dot(d, d))
    return float(np.dot(d[1:], d[:-1]) / denom) if denom > 0 else 0.0


MAX_RHO = 0.9  # beyond this the AR(1) view says "ten times the requests": the caller's cap decides, not rho


def effective_fraction(ttft_in_send_order: Sequence[float]) -> float:
    """n_eff / n of a replay's TTFTs in send order: (1 - rho) / (1 + rho) for the lag-1 autocorrelation rho.

    A rho within sampling noise of zero (below 2 / sqrt(n)) or negative counts as independent (1.0)."""
    n = len(ttft_in_send_order)
    rho = lag1_autocorrelation(ttft_in_send_order)
    if n < 3 or rho <= 2 / math.sqrt(n):
        return 1.0
    rho = min(rho, MAX_RHO)
    return (1 - rho) / (1 + rho)


@dataclass(frozen=True)
class P99Stability:
    """The P99 of a replay's TTFTs, its distribution-free confidence interval, and what would make it stable."""

    n: int
    p99_ms: float  # numpy's linear interpolation, as the metrics use
    low_ms: float  # -inf when open below
    high_ms: float  # inf when open above: too few requests for an upper bound
    relative_width: float  # (high - low) / p99, counting requests as independent; inf when open
    stable: bool  # relative_width <= tolerance, and at least requests_needed requests
    requests_needed: int | None  # predicted fewest requests for a stable P99 (None: the samples cannot tell)
    effective_fraction: float = 1.0  # n_eff / n from the TTFTs' correlation in send order

    def advice_text(self, tolerance: float = 0.4) -> str:
        """The line the end of a run prints for the recommendation's P99 stability (search/runner.py `p99_advice`)."""
        s = self
        high = "open above" if not math.isfinite(s.high_ms) else f"{s.high_ms:.0f} ms"
        line = (f"TTFT P99 of the recommendation over {s.n} requests: {s.p99_ms:.0f} ms, 95% interval "
                f"[{s.low_ms:.0f} ms, {high}]")
        if s.stable:
            return line + f": stable (within {tolerance:.0%} of it)"
        if s.requests_needed is None:
            return line + ": not stable; its tail is too short to say how many requests would make it so"
        return line + (f": not stable; about {s.requests_needed} requests per replay would pin it within "
                       f"{tolerance:.0%} (--num-requests {s.requests_needed}, or auto, in a new study)")


def p99_stability(ttft_ms: Sequence[float], tolerance: float = 0.4, confidence: float = 0.95,
                  q: float = P99) -> P99Stability:
    """Is the P99 of these TTFTs (ms, in send order) stable: is its `confidence` interval narrower than
    `tolerance` x P99, with enough requests for their correlation?"""
    finite = [v for v in ttft_ms if math.isfinite(v)]
    fraction = effective_fraction(finite)
    x = np.sort(np.asarray(finite, dtype=float))
    n = len(x)
    if n == 0:
        raise ValueError("no finite TTFT samples")
    estimate = float(np.percentile(x, 100 * q))
    low_rank, high_rank = quantile_ci_ranks(n, q, confidence)
    low = float(x[low_rank - 1]) if low_rank >= 1 else -math.inf
    high = float(x[high_rank - 1]) if high_rank is not None else math.inf
    width = (high - low) / estimate if estimate > 0 and math.isfinite(high - low) else math.inf
    needed = requests_needed(x, tolerance, confidence, q, fraction)
    return P99Stability(n, estimate, low, high, width, width <= tolerance and (needed is None or n >= needed),
                        needed, round(fraction, 3))


def exponential_tail(ttft_ms: Sequence[float], tail_fraction: float = 0.1) -> tuple[float, float, float] | None:
    """(threshold u, mean excess beta, share above u) of an exponential fit to the top `tail_fraction`."""
    x = np.sort(np.asarray(ttft_ms, dtype=float))
    k = max(int(round(tail_fraction * len(x))), 5)
    if len(x) < 2 * k:
        return None
    u = float(x[-k - 1])
    beta = float(np.mean(x[-k:] - u))
    if beta <= 0:
        return None
    return u, beta, k / len(x)


def predicted_width(n: int, tail: tuple[float, float, float], q: float = P99, confidence: float = 0.95) -> float:
    """Relative width of the q-quantile's interval over n samples, on the fitted exponential tail."""
    u, beta, share = tail
    low_rank, high_rank = quantile_ci_ranks(n, q, confidence)
    if high_rank is None or low_rank < 1:
        return math.inf

    def quantile(level: float) -> float:  # Q(p) = u + beta ln(share / (1 - p)) above the threshold
        return u + beta * math.log(share / max(1.0 - level, 1e-12))

    # the sorted sample of rank r sits near level r / (n + 1)
    lo, hi = quantile(low_rank / (n + 1)), quantile(high_rank / (n + 1))
    return (hi - lo) / quantile(q)


def requests_needed(ttft_ms: Sequence[float], tolerance: float = 0.4, confidence: float = 0.95,
                    q: float = P99, fraction: float = 1.0) -> int | None:
    """The fewest requests whose P99 interval is predicted within `tolerance` (None: no tail to fit), when only
    `fraction` of them count as independent draws (`effective_fraction`)."""
    iid = _requests_needed_iid(ttft_ms, tolerance, confidence, q)
    if iid is None:
        return None
    return min(math.ceil(iid / max(fraction, 1e-3)), MAX_REQUESTS)


def _requests_needed_iid(ttft_ms: Sequence[float], tolerance: float, confidence: float, q: float) -> int | None:
    tail = exponential_tail(ttft_ms)
    if tail is None or 1 - q >= tail[2]:
        return None
    n = min_requests_for_upper_bound(q, confidence)
    if predicted_width(n, tail, q, confidence) <= tolerance:
        return n
    hi = n
    while predicted_width(hi, tail, q, confidence) > tolerance:
        hi *= 2
        if hi > MAX_REQUESTS:
            return None
    lo = hi // 2
    while hi - lo > max(1, lo // 100):  # 1% is precise enough for a request count
        mid = (lo + hi) // 2
        if predicted_width(mid, tail, q, confidence) <= tolerance:
            hi = mid
        else:
            lo = mid
    return hi
