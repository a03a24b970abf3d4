"""The rate at several limits: each limit's pooled fit from its own counts, the lowest of them; and each limit's
constraint for Optuna."""

import math

import pytest

from optimizer.config.limits import parse_limits
from optimizer.measurement.evidence import FAIL, PASS
from optimizer.measurement.metrics import Distribution, ReplayMetrics
from optimizer.measurement.probe_rule import Evidence, LimitEvidence
from optimizer.measurement.rate_fit import fit_rate_at_limit
from optimizer.measurement.rate_search import (CANNOT_MEASURE, MISSED_ON_COUNT, CurvePoint, RateSearchResult,
                                                fit_at_limits, probe_counts)

LIMITS = parse_limits("150ms", "50ms")


def point(rate, n, ttft_over, tpot_over, ttft_p99=100.0, tpot_p99=40.0):
    """A probe of `n` requests at `rate`, with its counts over each limit."""
    d = lambda p99: Distribution(p99 / 2, p99 / 2, p99 / 2, p99, p99, p99)
    m = ReplayMetrics(offered_rate_rps=rate, achieved_rate_rps=rate, sent_rate_rps=rate, completed=n, failed=0,
                      duration_s=n / rate, request_throughput_rps=rate, output_throughput_tok_s=rate * 10,
                      total_token_throughput_tok_s=rate * 20, ttft=d(ttft_p99), tpot=d(tpot_p99), itl=d(10.0),
                      e2e=d(500.0))
    parts = (LimitEvidence("ttft:p99", PASS if ttft_over <= n / 100 else FAIL, n, ttft_over, share=0.01),
             LimitEvidence("tpot:p99", PASS if tpot_over <= n / 100 else FAIL, n, tpot_over, share=0.01))
    verdict = PASS if all(p.verdict == PASS for p in parts) else FAIL
    binding = max(parts, key=lambda p: p.over_limit).key
    b = next(p for p in parts if p.key == binding)
    return CurvePoint.of_probe(m, Evidence(verdict, n, b.over_limit, False, n, limits=parts, binding=binding), LIMITS)


CURVE = [point(40.0, 800, 0, 2), point(50.0, 400, 1, 60), point(60.0, 200, 8, 150)]


def test_each_limit_is_fitted_on_its_own_counts_and_the_lowest_rate_wins():
    fit, key = fit_at_limits(CURVE)
    tpot = fit_rate_at_limit(probe_counts(CURVE, "tpot:p99"))
    ttft = fit_rate_at_limit(probe_counts(CURVE, "ttft:p99"))
    assert key == "tpot:p99" and fit.rate_rps == tpot.rate_rps < ttft.rate_rps
    assert fit.low_rps == min(tpot.low_rps, ttft.low_rps) and fit.high_rps == min(tpot.high_rps, ttft.high_rps)
    assert [p.over_limit for p in probe_counts(CURVE, "tpot:p99")] == [2, 60, 150]
    assert [p.over_limit for p in probe_counts(CURVE, "ttft:p99")] == [0, 1, 8]


def test_a_limit_met_at_no_rate_leaves_no_rate_at_the_limits():
    curve = [point(40.0, 200, 0, 120), point(50.0, 200, 0, 150)]
    fit, key = fit_at_limits(curve)
    assert fit is None and key == "tpot:p99"


def test_each_limit_is_a_constraint_measured_over_limit_minus_one():
    feasible = RateSearchResult(points=CURVE, best=CURVE[0])
    v = feasible.violations(LIMITS)
    assert v == {"ttft:p99": pytest.approx(100 / 150 - 1), "tpot:p99": pytest.approx(40 / 50 - 1)}
    over = [point(50.0, 200, 0, 100, tpot_p99=61.0), point(40.0, 200, 0, 60, tpot_p99=55.0)]
    missed = RateSearchResult(points=over).violations(LIMITS)
    assert missed["tpot:p99"] == pytest.approx(55 / 50 - 1) and missed["ttft:p99"] < 0  # the closest point
    # a miss on the count alone (its P99 within) still reads as a miss to Optuna
    counted = RateSearchResult(points=[point(40.0, 200, 0, 9, tpot_p99=49.0)]).violations(LIMITS)
    assert counted["tpot:p99"] == MISSED_ON_COUNT and counted["ttft:p99"] < 0
    nan = point(40.0, 200, 0, 0, tpot_p99=math.nan)
    assert RateSearchResult(points=[nan]).violations(LIMITS) == {"ttft:p99": CANNOT_MEASURE,
                                                                  "tpot:p99": CANNOT_MEASURE}
