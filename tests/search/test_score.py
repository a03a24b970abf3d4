"""One score and one recommendation: the trial export, verify, the progress bar, the end-of-run table and
`optimize report` name is the same, and the stored objective the sampler and pre-screen read is that score."""

import math

import pytest

from optimizer.config.limits import Limits
from optimizer.decision.decide import decide
from optimizer.search.attrs import CURVE
from optimizer.search.progress import best_text
from optimizer.search.confirmed import recommended
from optimizer.search.score import best_first, goodput, rank_trials, score_tok_s, study_limits
from tests.support.fakes import make_config, run_study


@pytest.fixture
def study_and_config(tmp_path, config_only_model):
    config = make_config(tmp_path, config_only_model, budget=8, seed=1)
    return run_study(tmp_path, config), config


def test_the_stored_objective_is_the_score_of_the_curve(study_and_config):
    study, config = study_and_config
    assert study_limits(study) == config.limits
    finished = [t for t in study.trials if CURVE.of(t)]
    assert len(finished) >= 5 and any(goodput(t) > 0 for t in finished) and any(goodput(t) == 0 for t in finished)
    for t in finished:
        assert score_tok_s(t, config.limits.first.value_ms) == pytest.approx(goodput(t), rel=1e-9), t.number


def test_every_reader_names_the_same_recommendation(study_and_config):
    study, config = study_and_config
    best = recommended(study)
    assert best is not None
    assert decide(study, config).best.number == best.number  # the end-of-run table and `optimize report`
    order = best_first(study)  # verify's candidates
    assert order[0].number == best.number
    scores = [score_tok_s(t, config.limits.first.value_ms) for t in order]
    assert scores == sorted(scores, reverse=True) and all(s > 0 for s in scores)
    bar = best_text(study)  # the progress display
    assert bar.startswith(f"best #{best.number}: {score_tok_s(best, config.limits.first.value_ms):.1f} tok/s at "), bar


def test_another_limit_asks_the_same_question_of_the_stored_curves(study_and_config):
    study, config = study_and_config
    loose = recommended(study, Limits.ttft_p99(10 * config.limits.first.value_ms))
    ranked = rank_trials(study.trials, config.engine_args, 10 * config.limits.first.value_ms)
    top = max((n for n, r in ranked.items() if r.answerable), key=lambda n: ranked[n].output_throughput_tok_s)
    assert loose is not None and loose.number == top
    # a limit nothing meets: no recommendation, whatever the stored values say
    assert recommended(study, Limits.ttft_p99(1e-3)) is None
    assert all(not math.isnan(score_tok_s(t, 1e-3)) and score_tok_s(t, 1e-3) == 0.0 for t in study.trials)
