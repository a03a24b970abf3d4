"""A trial's measurement as one typed value (optimizer/search/measured.py): made once from a rate search, stored with
its schema version, read back equal through the one reader; every other module reads it there; a study an older
optimizer stored is refused in one line by every command that reads it, and nothing in it changes."""

import ast
import hashlib
import math
from pathlib import Path

import optuna
import pytest
from optuna.trial import create_trial

from optimizer.cli.main import main
from optimizer.config.limits import Limit, Limits
from optimizer.measurement.rate_fit import RateAtLimit
from optimizer.measurement.rate_search import CurvePoint, RateSearchResult
from optimizer.search.attrs import STUDY_CONFIG
from optimizer.search.measured import (SCHEMA, OlderSchemaError, TrialMeasurement, check_schema, measurement_of,
                                       write_measurement)
from optimizer.search.objective import CONSTRAINT
from optimizer.search.study import DIRECTIONS, open_study, storage_for
from tests.support import synthetic

REPO = Path(__file__).resolve().parents[2]
TWO = Limits(items=(Limit(metric="ttft", stat="p99", value_ms=100.0), Limit(metric="tpot", stat="p99", value_ms=50.0)))


def probe(rate_rps, ttft_ms, tpot_ms, feasible, binding):
    return CurvePoint(offered_rate_rps=rate_rps, sent_rate_rps=rate_rps, achieved_rate_rps=rate_rps,
                      output_throughput_tok_s=100.0 * rate_rps, request_throughput_rps=rate_rps, ttft_p50_ms=ttft_ms / 2,
                      ttft_p99_ms=ttft_ms, tpot_p99_ms=tpot_ms, itl_p99_ms=tpot_ms, e2e_p99_ms=5000.0, completed=200,
                      failed=0, sustained=True, feasible=feasible, requests=200, over_limit=0 if feasible else 9,
                      verdict="pass" if feasible else "fail", stats={"ttft": {"p99": ttft_ms}, "tpot": {"p99": tpot_ms}},
                      binding=binding, limits_key=TWO.key)


def search() -> RateSearchResult:
    """Passed 5 req/s (TTFT 60 ms, TPOT 40 ms), failed 6 on TPOT (61 ms > 50 ms)."""
    ok, over = probe(5.0, 60.0, 40.0, True, "ttft:p99"), probe(6.0, 70.0, 61.0, False, "tpot:p99")
    return RateSearchResult(points=[ok, over], best=ok, fit=RateAtLimit(5.4, 5.1, 5.8, 400, 2), fit_limit="tpot:p99")


class Holder:
    """A trial as the objective writes to it."""

    def __init__(self):
        self.user_attrs = {}

    def set_user_attr(self, key, value):
        self.user_attrs[key] = value


def test_made_once_stored_and_read_back_equal():
    s = search()
    m = TrialMeasurement.of_search(s, s.best, TWO, [p.to_dict() for p in s.points])
    assert (m.feasible, m.rate_rps, m.failed_rate_rps, m.fit_limit, m.requests) == (True, 5.0, 6.0, "tpot:p99", 400)
    assert m.values_at_rate_ms == {"ttft:p99": 60.0, "tpot:p99": 40.0}
    assert m.bound_text == "TPOT P99 61 ms > 50 ms at 6.0 req/s" and m.bound.limit_key == "tpot:p99"
    assert m.rate_interval_rps == (5.1, 5.8) and m.fit == RateAtLimit(5.4, 5.1, 5.8, 400, 2)
    trial = Holder()
    write_measurement(trial, m)
    assert trial.user_attrs["result"]["schema"] == SCHEMA and len(trial.user_attrs["curve"]) == 2
    assert measurement_of(trial) == m
    assert measurement_of(Holder()) is None  # a trial that stored none


def test_an_open_interval_and_a_burst_survive_the_stored_form():
    s = search()
    s.fit = RateAtLimit(5.4, 5.1, math.inf, 400, 2)
    burst = probe(math.inf, 60.0, 40.0, True, "ttft:p99")
    m = TrialMeasurement.of_search(s, burst, TWO)
    trial = Holder()
    write_measurement(trial, m)
    back = measurement_of(trial)
    assert back.rate_rps is None and back.rate_interval_rps == (5.1, math.inf) and back == m


def test_only_the_reader_touches_the_stored_measurement():
    """RESULT and CURVE are read and written in search/measured.py alone (attrs.py names them)."""
    found = []
    for folder in ("optimizer", "benchmarks"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name in ("measured.py", "attrs.py") and path.parent.name == "search":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Name) and node.id in ("RESULT", "CURVE"):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, found


def old_study(tmp_path, name="old"):
    """A study as the optimizer stored it before the schema: its trials' results without a version."""
    config = synthetic.make_config(tmp_path, name)
    study = optuna.create_study(study_name=name, storage=config.storage_url, directions=DIRECTIONS)
    STUDY_CONFIG.set(study, config.model_dump_json())
    c = synthetic.curve(0)
    study.add_trial(create_trial(values=[420.0, 98.0], constraints={CONSTRAINT: 0.0},
                                 user_attrs={"curve": c, "result": {"feasible": True, "rate_rps": 4.2}, "baseline": True,
                                             "engine_config": synthetic.BASELINE_ENGINE}))
    return study, config


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


LINE = ("study 'old' was stored by an older optimizer (trial measurement schema 1; this optimizer reads schema 2): "
        "start a new study under another --study name, or read this one with the optimizer that made it")


def test_an_older_study_is_refused_in_one_line_by_every_command_and_left_as_it_was(tmp_path, capsys):
    study, config = old_study(tmp_path)
    db = tmp_path / "old.db"
    before = digest(db)
    with pytest.raises(OlderSchemaError) as e:
        measurement_of(study.trials[0])
    assert "trial #0 was stored by an older optimizer (trial measurement schema 1" in str(e.value)
    with pytest.raises(OlderSchemaError, match="study 'old' was stored by an older optimizer"):
        check_schema(study)
    with pytest.raises(OlderSchemaError):  # a resume: refused before anything is written
        open_study(config, storage_for(config.storage_url))
    for command in (["report"], ["export"], ["report", "--format", "json"]):
        capsys.readouterr()
        assert main([*command, "--study", "old", "--studies-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"error: {LINE}", err
        assert "Traceback" not in err
    assert main(["studies", "--studies-dir", str(tmp_path), "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert "not read: study 'old' was stored by an older optimizer (trial measurement schema 1" in out
    assert digest(db) == before


def test_settings_an_older_optimizer_stored_are_refused_in_one_line(tmp_path, capsys):
    """A study whose stored settings name a field this optimizer no longer has (an earlier rate search's
    `step_down`) is refused with the fix, not read half-way."""
    import json

    _, config = old_study(tmp_path)
    optuna.delete_study(study_name="old", storage=config.storage_url)
    study = optuna.create_study(study_name="old", storage=config.storage_url, directions=DIRECTIONS)  # no trials
    stored = json.loads(config.model_dump_json())
    stored["rate_search"] = {**stored.get("rate_search", {}), "step_down": 0.6}
    STUDY_CONFIG.set(study, json.dumps(stored))
    for command in (["report"], ["--study", "old", "--budget", "3"]):
        capsys.readouterr()
        args = command if command[0] == "--study" else [*command, "--study", "old"]
        assert main([*args, "--studies-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith("error: study 'old' was stored by") and "start a new study" in err, err


def test_a_study_of_this_schema_passes_the_check(tmp_path):
    study, _ = synthetic.build(tmp_path)
    check_schema(study)
    assert all(measurement_of(t) is not None for t in study.trials if t.state.name == "COMPLETE")


def test_a_trial_stopped_between_its_two_writes_reads_as_none_and_refuses_nothing(tmp_path):
    """The curve is written first, the rest after it: a trial with a curve alone stored no whole measurement."""
    study, _ = synthetic.build(tmp_path)
    study.add_trial(create_trial(values=[1.0, 1.0], constraints={CONSTRAINT: 0.0},
                                 user_attrs={"curve": synthetic.curve(1)}))
    check_schema(study)  # not taken for an older study
    assert measurement_of(study.trials[-1]) is None


def test_a_newer_schema_says_upgrade_not_older():
    trial = Holder()
    trial.set_user_attr("result", {"schema": SCHEMA + 1, "feasible": True})
    with pytest.raises(OlderSchemaError, match=r"stored by a newer optimizer \(trial measurement schema 3; this "
                                               r"optimizer reads schema 2\): upgrade this optimizer to read it"):
        measurement_of(trial)
