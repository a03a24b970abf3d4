"""Re-ranking a finished study for other limits from the requests it stored (optimizer/search/rejudge.py), on a
simulated TTFT-only study: judged again at its own limits, every probe gives back the counts the search stored; at
a TPOT limit too, each probe is judged on both from the same requests, the rate at the limits comes with its
interval, and a trial that never probed low enough is named as one that cannot be ranked."""

import math

import pytest

from optimizer.cli.main import main
from optimizer.config.limits import parse_limits
from optimizer.decision.decide import decide
from optimizer.measurement.rerank import Answer
from optimizer.search.measured import measurement_of
from optimizer.search.records import RecordStore
from optimizer.search.rejudge import rejudge
from tests.support.fakes import config_only_model_in, make_config, run_study

TTFT_MS, TPOT_MS = 30.0, 12.0  # on the simulator's demo model, the TPOT limit binds vLLM's defaults


@pytest.fixture(scope="module")
def ttft_study(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rejudge")
    config = make_config(tmp, config_only_model_in(tmp), limits=parse_limits(f"{TTFT_MS}ms"), budget=5)
    return run_study(tmp, config), config, tmp


def measured_trials(study):
    return [t for t in study.trials if t.state.name == "COMPLETE" and measurement_of(t) is not None]


def test_judged_again_at_its_own_limits_each_probe_gives_back_its_stored_counts(ttft_study):
    study, config, _ = ttft_study
    store = RecordStore.existing(config.storage_url)
    compared = 0
    for t in measured_trials(study):
        m = measurement_of(t)
        again = rejudge(m, store.load(config.study_name, t.number), config, config.limits)
        assert again is not None and len(again.curve) == len(m.curve)
        for stored, judged in zip(m.curve, again.curve):
            if stored.get("verdict") is None:
                continue
            assert (judged["requests"], judged["over_limit"]) == (stored["requests"], stored["over_limit"])
            assert judged["stats"]["ttft"]["p99"] == pytest.approx(stored["stats"]["ttft"]["p99"])
            assert judged["feasible"] == stored["feasible"], (t.number, stored["offered_rate_rps"])
            compared += 1
        if m.rate_at_limit is not None and again.fit is not None:  # the same counts: the same fit, up to its bootstrap
            assert again.fit.rate_rps == pytest.approx(m.rate_at_limit.rate_rps, rel=1e-6)
    store.close()
    assert compared >= 5


def test_at_a_tpot_limit_too_each_probe_is_judged_on_both_with_an_interval(ttft_study):
    study, config, _ = ttft_study
    both = parse_limits(f"{TTFT_MS}ms", f"{TPOT_MS}ms")
    store = RecordStore.existing(config.storage_url)
    d = decide(study, config, both, store)
    assert d.reranked
    judged = [v for v in d.views if v.rejudged is not None]
    assert judged and len(judged) == len(measured_trials(study))
    for v in judged:
        for p in v.rejudged.curve:
            if p.get("verdict") is None:
                continue
            assert p["limits_key"] == both.key and {x["key"] for x in p["limits"]} == {"ttft:p99", "tpot:p99"}
            tpot_ms = p["stats"]["tpot"]["p99"]
            if tpot_ms > 1.5 * TPOT_MS:  # far over the TPOT limit: no verdict passes it
                assert not p["feasible"]
    answered = [v for v in judged if v.ranked.answerable]
    assert answered, "some trial meets both limits at some stored rate"
    for v in answered:
        fit = v.fit_under(True)
        if fit is not None:
            assert fit.low_rps <= fit.rate_rps <= fit.high_rps and fit.probes >= 1
    base = next(v for v in d.views if v.baseline)
    own = decide(study, config)
    if base.ranked.answerable and own.views[0].ranked.answerable:  # the TPOT limit costs rate, never adds it
        assert base.ranked.rate_rps <= own.views[0].ranked.rate_rps


def test_a_limit_no_stored_probe_meets_names_the_rates_never_probed(ttft_study, capsys):
    study, config, tmp = ttft_study
    capsys.readouterr()
    assert main(["report", "--study", config.study_name, "--studies-dir", str(tmp), "--ttft-p99", f"{TTFT_MS}ms",
                 "--tpot-p99", "0.5ms"]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert "no stored replay meets" in text and "Rates below the stored ones were not tried (#0 (nothing below " \
        in text, text
    assert "judged again at them from its stored requests" in text, text
    d = decide(study, config, parse_limits(f"{TTFT_MS}ms", "0.5ms"), RecordStore.existing(config.storage_url))
    assert all(v.ranked.answer in (Answer.NO_POINT, Answer.NOT_RUN) for v in d.views)
    assert all(v.rejudged.unprobed_below_rps is not None and math.isfinite(v.rejudged.unprobed_below_rps)
               for v in d.views if v.rejudged is not None)
