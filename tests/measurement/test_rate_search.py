"""The in-trial rate search on scripted replays: the engine 'sustains' up to a known knee."""

import asyncio
import math

import pytest

from optimizer.config.settings import RateSearchSpec
from optimizer.measurement.metrics import Distribution, ReplayMetrics
from optimizer.measurement.rate_search import find_max_rate


def fake_metrics(rate, ttft_p99_ms, achieved=None, burst_rps=20.0):
    sent = math.inf if rate == math.inf else rate
    d = Distribution(ttft_p99_ms / 2, ttft_p99_ms / 2, ttft_p99_ms, ttft_p99_ms)
    req_tput = burst_rps if rate == math.inf else (achieved or rate)
    return ReplayMetrics(offered_rate_rps=rate, achieved_rate_rps=achieved or (req_tput), sent_rate_rps=sent,
                         completed=100, failed=0, duration_s=100 / req_tput, request_throughput_rps=req_tput,
                         output_throughput_tok_s=req_tput * 10, total_token_throughput_tok_s=req_tput * 20,
                         ttft=d, tpot=d, itl=d, e2e=d)


def knee_engine(knee_rps, calls):
    async def replay_at(rate):
        calls.append(rate)
        if rate == math.inf:
            return fake_metrics(rate, 5000.0)
        return fake_metrics(rate, 50.0 if rate <= knee_rps else 200.0 + 100.0 * (rate - knee_rps))
    return replay_at


def run(replay_at, limit=150.0, **kw):
    return asyncio.run(find_max_rate(replay_at, limit, RateSearchSpec(**kw)))


def test_burst_first_then_down_then_bisect():
    calls = []
    res = run(knee_engine(13.0, calls), max_replays=10, step_down=0.5, refine_steps=2)
    # burst ceiling 20 -> 10 (ok) -> bisect (10+20)/2=15 (no) -> 12.5 (ok)
    assert calls == [math.inf, 10.0, 15.0, 12.5]
    assert res.best.offered_rate_rps == 12.5
    assert res.best.output_throughput_tok_s == 125.0
    assert res.violation_ms(150.0) == 0.0
    assert [p.feasible for p in res.points] == [False, True, False, True]


def test_keeps_stepping_down_until_feasible():
    calls = []
    res = run(knee_engine(3.0, calls), max_replays=10, step_down=0.5, refine_steps=0)
    assert calls == [math.inf, 10.0, 5.0, 2.5]
    assert res.best.offered_rate_rps == 2.5


def test_never_feasible_reports_the_closest_miss():
    calls = []
    res = run(knee_engine(0.0, calls), max_replays=4, step_down=0.5)
    assert calls == [math.inf, 10.0, 5.0, 2.5]
    assert res.best is None and not res.feasible
    assert res.violation_ms(150.0) == 450.0 - 150.0


def test_stops_when_lower_rates_no_longer_cut_latency():
    calls = []

    async def replay_at(rate):
        calls.append(rate)
        return fake_metrics(rate, 5000.0 if rate == math.inf else 400.0)
    res = run(replay_at, max_replays=10, step_down=0.5)
    # 10, 5 and 2.5 req/s show the same TTFT: the limit is below this config's unloaded latency
    assert calls == [math.inf, 10.0, 5.0, 2.5] and res.best is None


def test_keeps_descending_while_latency_still_falls():
    calls = []

    async def replay_at(rate):
        calls.append(rate)
        return fake_metrics(rate, 5000.0 if rate == math.inf else 100.0 + 40.0 * rate)
    res = run(replay_at, max_replays=10, step_down=0.5, refine_steps=0)
    assert calls == [math.inf, 10.0, 5.0, 2.5, 1.25] and res.best.offered_rate_rps == 1.25


def test_a_rate_not_sustained_is_not_feasible_even_with_low_ttft():
    async def replay_at(rate):
        if rate == math.inf:
            return fake_metrics(rate, 5000.0)
        return fake_metrics(rate, 10.0, achieved=rate * (0.5 if rate > 6 else 1.0))
    res = run(replay_at, max_replays=10, step_down=0.5, refine_steps=0)
    assert res.best.offered_rate_rps == 5.0
    assert not res.points[1].sustained


def test_feasible_burst_ends_the_search():
    calls = []

    async def replay_at(rate):
        calls.append(rate)
        return fake_metrics(rate, 20.0)
    res = run(replay_at)
    assert calls == [math.inf] and res.best.offered_rate_rps == math.inf


def test_respects_max_replays():
    calls = []
    run(knee_engine(13.0, calls), max_replays=3, step_down=0.5, refine_steps=5)
    assert len(calls) == 3


def test_stops_below_the_incumbents_rate():
    calls = []
    res = asyncio.run(find_max_rate(knee_engine(3.0, calls), 150.0, RateSearchSpec(step_down=0.5, max_replays=10),
                                    incumbent_rate_rps=6.0))
    # burst ceiling 20 -> 10 (no) -> 5 would be below 0.9 x 6 = 5.4: the floor itself, once (no) -> stop
    assert calls == [math.inf, 10.0, pytest.approx(5.4)]
    assert res.best is None and res.stopped_early


def test_a_config_that_holds_at_the_incumbents_floor_is_searched_up_from_there():
    """P99 near the knee is noisy: a config that misses at the incumbent's rate gets one try at the floor."""
    calls = []
    res = asyncio.run(find_max_rate(knee_engine(5.6, calls), 150.0,
                                    RateSearchSpec(step_down=0.5, max_replays=10, refine_steps=1),
                                    incumbent_rate_rps=6.0))
    # 20 -> 10 (no) -> floor 5.4 (ok) -> bisect (5.4 + 10) / 2 = 7.7 (no)
    assert calls == [math.inf, 10.0, pytest.approx(5.4), pytest.approx(7.7)]
    assert res.best.offered_rate_rps == pytest.approx(5.4) and not res.stopped_early


def test_probes_at_the_incumbents_rate_first_when_the_usual_start_is_below_it():
    calls = []
    res = asyncio.run(find_max_rate(knee_engine(16.0, calls), 150.0,
                                    RateSearchSpec(step_down=0.5, max_replays=10, refine_steps=1),
                                    incumbent_rate_rps=14.0))
    # ceiling 20 x 0.5 = 10 would be below the incumbent's 14: ask at 14 (ok), then bisect (14+20)/2 = 17 (no)
    assert calls == [math.inf, 14.0, 17.0]
    assert res.best.offered_rate_rps == 14.0


def test_a_ceiling_below_the_incumbent_ends_after_the_burst():
    calls = []
    res = asyncio.run(find_max_rate(knee_engine(16.0, calls), 150.0, RateSearchSpec(), incumbent_rate_rps=30.0))
    assert calls == [math.inf] and res.stopped_early and res.best is None


def test_incumbent_does_not_stop_a_competitive_config():
    calls = []
    res = asyncio.run(find_max_rate(knee_engine(13.0, calls), 150.0,
                                    RateSearchSpec(step_down=0.5, max_replays=10, refine_steps=0),
                                    incumbent_rate_rps=6.0))
    assert res.best.offered_rate_rps == 10.0 and not res.stopped_early


def bisect(replay_at, start, failed=None, limit=150.0, **kw):
    from optimizer.measurement.rate_search import bisect_rate

    return asyncio.run(bisect_rate(replay_at, limit, RateSearchSpec(), start, failed, **kw))


def test_bisection_from_a_passing_start_brackets_the_knee_within_3_percent():
    calls = []
    res = bisect(knee_engine(10.0, calls), 9.0)
    # 9 passes, 9 x 1.15 = 10.35 fails, then geometric middles until failed / passed <= 1.03
    assert calls[:2] == [9.0, pytest.approx(10.35)]
    assert res.best.offered_rate_rps <= 10.0 < res.failed_rate_rps
    assert res.failed_rate_rps / res.best.offered_rate_rps <= 1.03
    assert len(calls) <= 6


def test_bisection_from_a_failing_start_steps_down():
    calls = []
    res = bisect(knee_engine(6.0, calls), 9.0, failed=None)
    assert calls[0] == 9.0 and calls[1] == pytest.approx(9.0 / 1.15) and calls[2] == pytest.approx(9.0 / 1.15 ** 2)
    assert res.best.offered_rate_rps <= 6.0 < res.failed_rate_rps <= 1.03 * res.best.offered_rate_rps


def test_bisection_uses_the_known_failed_rate_first():
    calls = []
    bisect(knee_engine(10.0, calls), 9.5, failed=10.6)
    assert calls[:2] == [9.5, 10.6]


def test_bisection_of_a_burst_that_meets_the_limit_again_stops_there():
    calls = []

    async def everything_fits(rate):
        calls.append(rate)
        return fake_metrics(rate, 20.0)

    res = bisect(everything_fits, math.inf)
    assert calls == [math.inf] and math.isinf(res.best.offered_rate_rps)


def test_bisection_that_never_meets_the_limit_has_no_best():
    res = bisect(knee_engine(0.01, []), 9.0, max_replays=5)
    assert res.best is None and res.failed_rate_rps is None and len(res.points) == 5


def test_failed_rate_of_a_search_is_the_lowest_miss_above_its_best():
    res = run(knee_engine(13.0, []), max_replays=10, step_down=0.5, refine_steps=2)
    assert res.best.offered_rate_rps == 12.5 and res.failed_rate_rps == 15.0
