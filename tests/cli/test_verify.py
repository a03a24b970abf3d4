"""`optimize verify` on the simulator: the table, the lines and the JSON name every limit of the study."""

import json

from optimizer.cli.main import main
from optimizer.config.limits import Limit, Limits
from tests.support.fakes import SimEngine, make_config, run_study

TTFT_TPOT = Limits(items=(Limit(metric="ttft", stat="p99", value_ms=30.0), Limit(metric="tpot", stat="p99",
                                                                                  value_ms=1000.0)))


def test_verify_names_every_limit_in_its_table_and_json(tmp_path, config_only_model, capsys, monkeypatch):
    from optimizer.search import runner

    config = make_config(tmp_path, config_only_model).model_copy(update={"limits": TTFT_TPOT})
    run_study(tmp_path, config)
    monkeypatch.setattr(runner, "factory_for", lambda config, path: SimEngine)  # the engine the study ran on
    rc = main(["verify", "--study", "s", "--studies-dir", str(tmp_path), "--top", "1", "--seeds", "1", "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == "each variant: TTFT P99 / TPOT P99, against TTFT P99 <= 30ms, TPOT P99 <= 1.00s"
    header = lines[1].split()
    assert header[:3] == ["trial", "output_tok_s", "rate_rps"] and "worst_ttft_p99" in header \
        and "worst_tpot_p99" in header
    assert "TTFT P99" in lines[-1] and "TPOT P99" in lines[-1]  # the choice's worst of each, or the line naming both
    payload = json.loads((tmp_path / "s.verify.json").read_text())
    assert payload["limits"] == {"items": [{"metric": "ttft", "stat": "p99", "value_ms": 30.0},
                                           {"metric": "tpot", "stat": "p99", "value_ms": 1000.0}],
                                 "goodput_pct": None}
    assert "limit_ms" not in payload
    assert set(payload["results"][0]["worst_ms"]) == {"ttft:p99", "tpot:p99"}
