"""The product as users run it, on the real vLLM CPU engine: study, resume, pruning, export -> engine start.

Slow by nature (an engine start is ~20 s here): the scenario is one module-scoped study, reused by the tests.
"""

import asyncio
import json
import shlex
import subprocess
import sys

import psutil
import pytest
from optuna.trial import TrialState

from optimizer.config.model import DEFAULT_MODEL_NAME, DEMO_LADDER
from optimizer.search.objective import CONSTRAINT
from tests.conftest import REPO, subprocess_env
from tests.support.fakes import load

pytestmark = pytest.mark.engine

SMALL = ["--num-requests", "20", "--input-len", "16:96", "--output-len", "4:12", "--ttft-p99", "150ms"]


def optimize(cache, studies, *args, timeout=900):
    proc = subprocess.run([sys.executable, "-m", "optimizer", *args, "--studies-dir", str(studies)],
                          cwd=REPO, env=subprocess_env(cache), capture_output=True, text=True, timeout=timeout)
    return proc


def finished(study):
    return study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))


@pytest.fixture(scope="module")
def studies(tmp_path_factory, tiny_model, model_cache):
    """A 2-trial study on the embedded default model, run through the CLI as a user would: vLLM's defaults and one
    searched config, the least that has a baseline, a search and a recommendation (each trial more is an engine
    start and its replays; the resume below adds the third)."""
    d = tmp_path_factory.mktemp("studies")
    proc = optimize(model_cache, d, *SMALL, "--budget", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (d / "first.out").write_text(proc.stdout + proc.stderr)
    return d


def test_study_persists_with_baseline_first(studies):
    study = load(studies)
    done = finished(study)
    assert len(done) == 2
    assert done[0].user_attrs.get("baseline") and done[0].params == {}
    assert sum(bool(t.user_attrs.get("baseline")) for t in study.trials) == 1
    out = (studies / "first.out").read_text()
    assert "recommended" in out and "vLLM defaults" in out
    # the demo was sized to this machine by a probe of the real engine, stored with the study
    scale = study.user_attrs["demo_scale"]
    assert scale["scale"]["model"] in {s.name for s in DEMO_LADDER}
    assert f"embedded default {scale['scale']['model']}" in out and f"demo scale: {scale['scale']['model']}" in out
    assert scale["probe"]["prefill_ms"] > 0 and scale["probe"]["burst_rps"] > 0
    assert study.user_attrs["machine"]["cores"] >= 1 and out.count("dtype: ") == 1
    for t in done:
        if t.state == TrialState.COMPLETE:
            curve = t.user_attrs["curve"]  # Poisson probes only, each with its counts: no burst in the curve
            assert curve and all(p["offered_rate_rps"] is not None and p["requests"] for p in curve)
            assert t.user_attrs["result"]["measurement"] == "probes sized by evidence, pooled fit"
            assert t.user_attrs["engine_config"]["max_num_seqs"] >= 1
            assert CONSTRAINT in t.constraints
        log = t.user_attrs["log_file"]
        assert "EngineCore" in open(log).read()  # the engine child's own output lands in the trial's log


def test_no_engine_process_outlives_its_trial(studies):
    study = load(studies)
    pids = [p for t in study.trials for p in t.user_attrs.get("engine_pids", [])]
    assert pids, "engine PIDs are recorded"
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_resume_adds_trials_and_repeats_nothing(studies, model_cache):
    before = {t.number: (t.datetime_complete, t.params) for t in finished(load(studies))}
    proc = optimize(model_cache, studies, "--budget", "3")  # no flags repeated: the stored config is used
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming study 'default': 2 trials finished, budget 3 trials" in proc.stderr
    assert "probe: " not in proc.stderr  # a resume never probes the machine again
    study = load(studies)
    done = finished(study)
    assert len(done) == 3
    assert {t.number: (t.datetime_complete, t.params) for t in done if t.number in before} == before
    assert sum(bool(t.user_attrs.get("baseline")) for t in study.trials) == 1


def test_export_yaml_starts_a_vllm_engine_with_the_recommended_values(studies, model_cache, tmp_path):
    proc = optimize(model_cache, studies, "export")
    assert proc.returncode == 0, proc.stderr
    from optimizer.decision.export import serve_launcher

    assert proc.stdout.startswith(shlex.join(serve_launcher()) + " ")  # the server module on the CPU build
    path = studies / "default.recommended.yaml"
    text = path.read_text()
    assert "# SLO: TTFT P99 <= 150ms" in text

    from optimizer.engines.vllm_engine import VllmEngine
    from optimizer.search.confirmed import recommended
    from tests.support.serve_parser import parse_serve

    args = parse_serve(["--config", str(path)])  # `vllm serve`'s own parser: false booleans must survive it
    kwargs = {k: getattr(args, k) for k in ("model", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                            "gpu_memory_utilization", "enable_chunked_prefill",
                                            "enable_prefix_caching", "block_size", "long_prefill_token_threshold",
                                            "enforce_eager", "dtype")}
    engine = VllmEngine({})

    async def start_and_stop():
        try:
            return await engine.start(kwargs, tmp_path / "export.log")
        finally:
            await engine.shutdown()

    resolved = asyncio.run(start_and_stop())
    expected = recommended(load(studies)).user_attrs["engine_config"]
    assert {k: v for k, v in resolved.items() if k != "num_kv_blocks"} == \
        {k: v for k, v in expected.items() if k != "num_kv_blocks"}


def test_config_that_runs_out_of_memory_is_pruned_with_its_reason(tmp_path, model_cache, tiny_model):
    space = tmp_path / "space.yaml"
    space.write_text("gpu_memory_utilization: 0.99\n")
    proc = optimize(model_cache, tmp_path, *SMALL, "--model", DEFAULT_MODEL_NAME, "--budget", "2", "--study", "oom",
                    "--space", str(space))
    assert proc.returncode == 0, proc.stderr[-3000:]
    study = load(tmp_path, "oom")
    assert [t.state for t in study.trials] == [TrialState.PRUNED, TrialState.PRUNED]  # the study went on
    for t in study.trials:
        assert t.user_attrs["pruned_reason"] == "out_of_memory"
        assert "memory" in t.user_attrs["pruned_detail"].lower()
        assert t.constraints[CONSTRAINT] > 0
    assert "No trial met the limit" in proc.stdout
    proc = optimize(model_cache, tmp_path, "export", "--study", "oom")
    assert proc.returncode == 1 and "nothing to export" in proc.stderr


def test_verify_measures_the_best_configs_again(studies, model_cache):
    proc = optimize(model_cache, studies, "verify", "--top", "2", "--seeds", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bursty (gamma 0.5)" in proc.stdout and "worst_ttft_p99" in proc.stdout
    data = json.loads((studies / "default.verify.json").read_text())
    assert 1 <= len(data["results"]) <= 2
    for r in data["results"]:
        assert len(r["points"]) == 3 and not r["error"]
        assert all(p["completed"] == 20 for p in r["points"].values())
    assert load(studies).user_attrs["verify"]["results"][0]["trial_number"] == data["results"][0]["trial_number"]
