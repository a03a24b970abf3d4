"""Re-ranking stored curves for another limit: small curves whose answers are checked by hand."""

import math

import pytest

from optimizer.measurement.rerank import Answer, Ranked, dominates, pareto_front, qualifies, rank_curve, recommend


def pt(rate, ttft_ms, tok_s=None, sustained=True):
    """A curve point; throughput defaults to 100 tokens per request at the offered rate."""
    return {"offered_rate_rps": rate, "ttft_p99_ms": ttft_ms, "sustained": sustained,
            "output_throughput_tok_s": tok_s if tok_s is not None else rate * 100, "stats": {"ttft": {"p99": ttft_ms}}}


# The shape a rate search leaves: a burst, steps down by 0.6 until one passes, then bisection upwards.
CURVE = [pt(None, 500, tok_s=1000), pt(6.0, 250), pt(3.6, 120), pt(4.8, 180), pt(4.2, 140)]


def test_a_point_qualifies_when_sustained_and_within_the_limit():
    assert qualifies(pt(1.0, 100), 100)  # the limit itself is allowed
    assert not qualifies(pt(1.0, 100.01), 100)
    assert not qualifies(pt(1.0, 10, sustained=False), 100)  # fast only because it never kept pace
    assert not qualifies(pt(1.0, math.nan), 100)  # no request completed


def test_the_highest_qualifying_rate_wins_and_the_next_tried_rate_brackets_it():
    r = rank_curve(CURVE, 150)  # 3.6 (120 ms) and 4.2 (140 ms) qualify; 4.8 (180 ms) does not
    assert r.answer == Answer.MEASURED
    assert r.rate_rps == 4.2 and r.output_throughput_tok_s == pytest.approx(420)
    assert r.ttft_p99_ms == 140 and r.next_rate_rps == 4.8


def test_a_looser_limit_moves_up_the_curve():
    r = rank_curve(CURVE, 200)  # 4.8 (180 ms) now qualifies; 6.0 (250 ms) still misses
    assert (r.answer, r.rate_rps, r.next_rate_rps) == (Answer.MEASURED, 4.8, 6.0)


def test_when_the_highest_poisson_rate_tried_qualifies_the_answer_is_a_lower_bound():
    r = rank_curve(CURVE, 300)  # 6.0 qualifies, nothing above it but the burst (500 ms) was tried
    assert r.answer == Answer.LOWER_BOUND and r.answerable
    assert r.rate_rps == 6.0 and r.output_throughput_tok_s == pytest.approx(600) and r.next_rate_rps is None


def test_a_qualifying_burst_is_the_ceiling():
    r = rank_curve(CURVE, 500)
    assert r.answer == Answer.CEILING and r.rate_rps is None and r.output_throughput_tok_s == 1000


def test_a_stricter_limit_than_every_stored_point_has_no_answer_but_names_the_closest():
    r = rank_curve(CURVE, 100)
    assert r.answer == Answer.NO_POINT and not r.answerable
    assert r.point is None and math.isnan(r.output_throughput_tok_s)
    assert r.closest["offered_rate_rps"] == 3.6  # 120 ms, the lowest stored TTFT P99


def test_an_unsustained_higher_rate_brackets_but_never_answers():
    curve = [pt(None, 900, tok_s=800), pt(5.0, 40, sustained=False), pt(3.0, 60)]
    r = rank_curve(curve, 100)
    assert (r.answer, r.rate_rps, r.next_rate_rps) == (Answer.MEASURED, 3.0, 5.0)


def test_no_curve_means_the_trial_could_not_run():
    assert rank_curve(None, 100).answer == Answer.NOT_RUN
    assert rank_curve([], 100).answer == Answer.NOT_RUN


def test_dominance_needs_one_strict_improvement():
    assert dominates((100, 50), (90, 50)) and dominates((100, 40), (100, 50))
    assert not dominates((100, 50), (100, 50)) and not dominates((100, 60), (90, 50))


def ranked(tok_s, ttft_ms, answer=Answer.MEASURED):
    return Ranked(answer, point={"output_throughput_tok_s": tok_s, "ttft_p99_ms": ttft_ms, "offered_rate_rps": 1})


def test_pareto_front_by_hand():
    entries = {
        1: ranked(100, 50),  # front: most throughput
        2: ranked(90, 40),  # front: less throughput, lower latency
        3: ranked(80, 60),  # dominated by 1 and 2
        4: ranked(60, 10),  # front: the lowest latency
        5: ranked(95, 45),  # front: between 1 and 2
        6: Ranked(Answer.NO_POINT),  # not answerable: never on the front
    }
    assert pareto_front(entries) == [1, 5, 2, 4]
    assert recommend(entries) == 1


def test_recommendation_ties_go_to_the_lower_ttft_then_the_earlier_trial():
    assert recommend({1: ranked(100, 50), 2: ranked(100, 40)}) == 2
    assert recommend({3: ranked(100, 40), 2: ranked(100, 40)}) == 2
    assert recommend({1: Ranked(Answer.NOT_RUN)}) is None


def test_other_latency_limits_narrow_the_answer():
    from optimizer.measurement.rerank import rank_curve

    curve = [
        {"offered_rate_rps": None, "sustained": True, "stats": {"ttft": {"p99": 900.0}, "tpot": {"p99": 40.0}},
         "output_throughput_tok_s": 1000.0},
        {"offered_rate_rps": 8.0, "sustained": True, "stats": {"ttft": {"p99": 90.0}, "tpot": {"p99": 30.0}},
         "output_throughput_tok_s": 800.0},
        {"offered_rate_rps": 4.0, "sustained": True, "stats": {"ttft": {"p99": 60.0}, "tpot": {"p99": 12.0}},
         "output_throughput_tok_s": 400.0},
    ]
    from optimizer.config.limits import parse_limits

    assert rank_curve(curve, 100.0).rate_rps == 8.0
    assert rank_curve(curve, parse_limits("100ms", "20ms")).rate_rps == 4.0  # TPOT rules out 8 req/s
    assert not rank_curve(curve, parse_limits("100ms", "5ms")).answerable
    assert not rank_curve(curve, parse_limits("100ms", e2e_p99="1000s")).answerable  # not stored: cannot answer
    assert not rank_curve(curve, parse_limits("100ms", slo=["tpot:p90=1s"])).answerable  # P90 not stored either


def test_repeats_at_one_rate_rank_as_their_median():
    from optimizer.measurement.rerank import merge_repeats

    def pt(rate, tput, ttft, sustained=True):
        return {"offered_rate_rps": rate, "output_throughput_tok_s": tput, "ttft_p99_ms": ttft,
                "sustained": sustained, "stats": {"ttft": {"p99": ttft}}}

    curve = [pt(None, 900, 5000), pt(6.0, 500, 120), pt(6.0, 400, 180), pt(6.0, 450, 140, sustained=False)]
    merged = merge_repeats(curve)
    assert len(merged) == 2 and merged[0] == curve[0]
    m = merged[1]
    assert (m["output_throughput_tok_s"], m["ttft_p99_ms"], m["replays"]) == (450, 140, 3)
    assert m["sustained"] is True  # 2 of 3
    assert m["output_throughput_cv"] == pytest.approx(50 / 450)  # sd of 400, 450, 500 is 50
    # under 150 ms the median (140 ms) qualifies though one replay (180 ms) missed; under 130 ms it does not
    assert rank_curve(curve, 150).output_throughput_tok_s == 450
    assert rank_curve(curve, 130).answer == Answer.NO_POINT
