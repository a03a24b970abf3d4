"""The confirmation on the real vLLM CPU engine, through the CLI as users run it: vLLM's defaults and the
recommendation measured again in alternating rounds, each on a fresh engine; the table carries the intervals, and
`optimize report` and `optimize export` show the confirmed numbers."""

import json
import re
import shlex

import pytest
from optuna.trial import TrialState

from optimizer.config.settings import RateSearchSpec
from optimizer.measurement.rate_search import BRACKET_PRECISION
from optimizer.search.attrs import BASELINE, CONFIRM, CURVE, ENGINE_PIDS, RESULT, STUDY_CONFIRMATION
from optimizer.search.confirmed import confirmation, recommended
from optimizer.search.study import confirmation_study, finished_count
from tests.e2e.test_e2e_engine import SMALL, optimize
from tests.support.fakes import load, unwrapped

pytestmark = pytest.mark.engine


def test_two_rounds_on_fresh_engines_give_the_table_its_intervals(tmp_path, tiny_model, model_cache):
    # 10 trials: 2 rounds of up to 3 configs (6 runs) and 2 runs through `vllm serve` leave the search 2 (vLLM's
    # defaults and one more)
    proc = optimize(model_cache, tmp_path, *SMALL, "--budget", "10", "--confirm", "2", "--study", "c")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("confirmation: up to 2 rounds of up to 3 configs, until they decide, come out of the budget of 10: 2 "
            "search trials, then up to 6 confirmation runs and 2 runs through `vllm serve`") in proc.stderr
    study = load(tmp_path, "c")
    assert finished_count(study) == 2
    # Optuna's own front: search trials (sampled parameters, or vLLM's defaults), never a run with params {}
    assert study.best_trials and all(t.params or BASELINE.of(t) for t in study.best_trials)
    assert not any(CONFIRM.of(t) is not None for t in study.trials)
    every = confirmation_study(study).trials  # the study c.confirmation
    runs = [t for t in every if not CONFIRM.of(t).get("served")]
    served = [t for t in every if CONFIRM.of(t).get("served")]
    plan = STUDY_CONFIRMATION.of(study)
    assert plan["candidates"][0] == 0 and len(runs) == 2 * len(plan["candidates"])
    assert all(t.state == TrialState.COMPLETE for t in every)
    pids = [tuple(ENGINE_PIDS.of(t)) for t in every]
    assert all(pids) and len(set(pids)) == len(pids)  # every run on an engine of its own
    # the runs as served: vLLM's defaults and the leader (when the defaults lead: the best other candidate still
    # measured, if any), each through a real `vllm serve`, after the rounds
    c = confirmation(study)
    assert sorted(CONFIRM.of(t)["of"] for t in served) == sorted(x.number for x in c.served_configs)
    assert c.served_configs[0].number == 0 and len(served) == len(c.served_configs) >= 1
    assert min(t.number for t in served) > max(t.number for t in runs)
    for t in served:
        log = (tmp_path / "c.logs" / f"confirm-{t.number:05d}.log").read_text(errors="replace")
        assert "vllm.entrypoints.openai.api_server" in log  # the server's command line heads its log
        assert RESULT.of(t)["feasible"] and RESULT.of(t)["rate_at_limit"]["rate_rps"] > 0
    logs = sorted(p.name for p in (tmp_path / "c.logs").glob("*.log"))
    assert [f"confirm-{t.number:05d}.log" for t in every] == [n for n in logs if n.startswith("confirm-")]
    line = next(x for x in proc.stderr.splitlines() if f"(run c{runs[0].number}, " in x)  # its console line ...
    shown = optimize(model_cache, tmp_path, "report", "--study", "c", "--trial", f"c{runs[0].number}")
    assert shown.returncode == 0 and line.strip() in shown.stdout  # ... names it as the report takes it
    for t in runs:
        r = RESULT.of(t)
        if r["feasible"] and r.get("failed_rate_rps"):  # bisected to within 3% whatever its fit said
            # (measurement/rate_search.py::RUN_FIT_BRACKET), or out of probes
            assert r["failed_rate_rps"] / r["rate_rps"] <= 1 + BRACKET_PRECISION + 1e-6 \
                or len(CURVE.of(t)) == RateSearchSpec().max_replays
    c = confirmation(study)
    assert c.complete and recommended(study).number == c.recommended.number
    out = proc.stdout
    (tmp_path / "out.txt").write_text(out + proc.stderr)
    print(out)
    lines = unwrapped(out)
    # the decision first, one of three outcomes with its rounds (measurement/sequential.py), then its deploy command
    assert re.fullmatch(r"decision: (deploy #\d+: [+-]\d+\.\d% output tok/s over vLLM's defaults .*\(2 rounds\)|"
                        r"keep vLLM's defaults: .*\(2 rounds\)|undecided after 2 rounds: .*)", lines[0]), out
    assert lines[1].startswith("deploy: ")
    assert any(line.startswith("confirmed in 2 rounds at TTFT P99 <= ") for line in lines), out
    served_lines = [line for line in lines if line.startswith("as served (vllm serve over HTTP, run c")]
    assert len(served_lines) == len(served) and all("req/s in process" in line for line in served_lines), out
    row = next(line for line in lines if line.startswith("#0 vLLM defaults"))
    assert re.search(r"\[\d+\.\d, \d+\.\d\]", row)  # the defaults' median with its interval
    report = optimize(model_cache, tmp_path, "report", "--study", "c")
    assert report.returncode == 0 and report.stdout.splitlines()[0] == lines[0]
    assert "confirmed in 2 rounds, alternating, each config on a fresh engine in process (AsyncLLM)" in report.stdout
    export = optimize(model_cache, tmp_path, "export", "--study", "c")
    assert export.returncode == 0, export.stderr[-2000:]
    deploy = out[out.index("deploy: ") + len("deploy: "):out.index("\n\n")]  # the command, over its lines
    assert shlex.split(deploy.replace("\\\n", "")) == shlex.split(export.stdout)  # as `optimize export` prints it
    meta = json.loads((tmp_path / "c.engine_args.json").read_text())["metadata"]
    assert meta["trial"] == c.recommended.number and meta["confirmed"]["rounds"] == 2
    assert meta["rate_at_limit"]["served_measured_as"] == "as served (vllm serve over HTTP)"
    assert meta["rate_at_limit"]["served_rate_at_limit_rps"] > 0
