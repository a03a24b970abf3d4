"""The confirmation on the real vLLM CPU engine, through the CLI as users run it: vLLM's defaults and the
recommendation measured again in alternating rounds, each on a fresh engine; the table carries the intervals, and
`optimize report` and `optimize export` show the confirmed numbers."""

import json
import re

import pytest
from optuna.trial import TrialState

from optimizer.config.settings import RateSearchSpec
from optimizer.search.attrs import BASELINE, CONFIRM, CURVE, ENGINE_PIDS, RESULT, STUDY_CONFIRMATION
from optimizer.search.score import confirmation, recommended
from optimizer.search.study import confirmation_study, finished_count
from tests.e2e.test_e2e_engine import SMALL, optimize
from tests.support.fakes import load

pytestmark = pytest.mark.engine


def test_two_rounds_on_fresh_engines_give_the_table_its_intervals(tmp_path, tiny_model, model_cache):
    # 8 trials: 2 rounds of up to 3 configs (6 runs) leave the search 2 (vLLM's defaults and one more)
    proc = optimize(model_cache, tmp_path, *SMALL, "--budget", "8", "--confirm", "2", "--study", "c")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("confirmation: up to 2 rounds of up to 3 configs, until they decide, come out of the budget of 8: 2 search "
            "trials") in proc.stderr
    study = load(tmp_path, "c")
    assert finished_count(study) == 2
    # Optuna's own front: search trials (sampled parameters, or vLLM's defaults), never a run with params {}
    assert study.best_trials and all(t.params or BASELINE.of(t) for t in study.best_trials)
    assert not any(CONFIRM.of(t) is not None for t in study.trials)
    runs = confirmation_study(study).trials  # the study c.confirmation
    plan = STUDY_CONFIRMATION.of(study)
    assert plan["candidates"][0] == 0 and len(runs) == 2 * len(plan["candidates"])
    assert all(t.state == TrialState.COMPLETE for t in runs)
    pids = [tuple(ENGINE_PIDS.of(t)) for t in runs]
    assert all(pids) and len(set(pids)) == len(pids)  # every run on an engine of its own
    logs = sorted(p.name for p in (tmp_path / "c.logs").glob("*.log"))
    assert [f"confirm-{t.number:05d}.log" for t in runs] == [n for n in logs if n.startswith("confirm-")]
    line = next(x for x in proc.stderr.splitlines() if f"(run c{runs[0].number}, " in x)  # its console line ...
    shown = optimize(model_cache, tmp_path, "report", "--study", "c", "--trial", f"c{runs[0].number}")
    assert shown.returncode == 0 and line.strip() in shown.stdout  # ... names it as the report takes it
    for t in runs:
        r = RESULT.of(t)
        if r["feasible"] and r.get("failed_rate_rps"):  # bisected to within 3%, its fit within +-3%, or out of probes
            fit = r["rate_at_limit"]
            assert r["failed_rate_rps"] / r["rate_rps"] <= 1.03 + 1e-6 \
                or (fit["high_rps"] - fit["low_rps"]) / 2 <= 0.03 * fit["rate_rps"] + 1e-6 \
                or len(CURVE.of(t)) == RateSearchSpec().max_replays
    c = confirmation(study)
    assert c.complete and recommended(study).number == c.recommended.number
    out = proc.stdout
    (tmp_path / "out.txt").write_text(out + proc.stderr)
    print(out)
    assert "confirmed in 2 rounds, alternating, each config on a fresh engine" in out
    row = next(line for line in out.splitlines() if line.startswith("vLLM defaults"))
    assert re.search(r"\[\d+\.\d, \d+\.\d\]", row)  # the defaults' median with its interval
    # the verdict, one of three, with its rounds (measurement/sequential.py)
    assert re.search(r"better than vLLM's defaults .* by [+-]\d+\.\d% output throughput.*, 2 rounds|"
                     r"within \+-\d+\.\d% of vLLM's defaults .*, 2 rounds: keep them|"
                     r"are better than every candidate .*, 2 rounds: keep them|undecided after 2 rounds", out)
    report = optimize(model_cache, tmp_path, "report", "--study", "c")
    assert report.returncode == 0 and "confirmed in 2 rounds" in report.stdout
    export = optimize(model_cache, tmp_path, "export", "--study", "c")
    assert export.returncode == 0, export.stderr[-2000:]
    meta = json.loads((tmp_path / "c.engine_args.json").read_text())["metadata"]
    assert meta["trial"] == c.recommended.number and meta["confirmed"]["rounds"] == 2
