"""Raw records in the study's database: every replay of every trial, enough to recompute any metric."""

import math

import pytest
from optuna.trial import TrialState

from optimizer.measurement.metrics import summarize
from optimizer.search.records import RecordStore
from tests.support.fakes import make_config, run_study


def test_every_replay_is_stored_and_recomputes_the_stored_curve(tmp_path, config_only_model):
    config = make_config(tmp_path, config_only_model, budget=2)
    study = run_study(tmp_path, config)
    store = RecordStore(config.storage_url)
    for trial in study.get_trials(states=(TrialState.COMPLETE,)):
        replays = store.load(config.study_name, trial.number)
        curve = trial.user_attrs["curve"]
        assert len(replays) == len(curve)
        for (rate, records), point in zip(replays, curve):
            # warm-up not stored; a probe sends until its verdict is settled, at most the workload's requests
            assert 0 < len(records) <= config.workload.num_requests
            assert len(records) == point["requests"]
            assert (point["offered_rate_rps"] is None) == math.isinf(rate)
            m = summarize(records, rate)
            assert m.ttft.p99_ms == pytest.approx(point["ttft_p99_ms"])
            assert m.output_throughput_tok_s == pytest.approx(point["output_throughput_tok_s"])
            assert m.itl.p99_ms == pytest.approx(point["itl_p99_ms"])
        # the trial's result names the counts of the probe at its rate (the line of a trial that missed prints them)
        result = trial.user_attrs["result"]
        at_rate = [(p["requests"], p["over_limit"], p["completed"]) for p in curve
                   if p["offered_rate_rps"] == result["rate_rps"]]
        assert (result["requests_at_rate"], result["over_limit_at_rate"], result["answered_at_rate"]) in at_rate
        assert result["behind_at_rate"] == (result["answered_at_rate"] > 0 and not next(
            p["sustained"] for p in curve if p["offered_rate_rps"] == result["rate_rps"]
            and p["requests"] == result["requests_at_rate"]))
        # and they are the stored requests' own: the answered ones completed, the sent ones all stored
        probe = [records for rate, records in replays
                 if rate == result["rate_rps"] and len(records) == result["requests_at_rate"]]
        assert probe and result["answered_at_rate"] in [sum(r.ok for r in records) for records in probe]
    store.close()
