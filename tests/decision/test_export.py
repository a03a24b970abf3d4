"""`optimize export`: the serve command and YAML as before, plus engine-kwargs JSON and a compose service."""

import json
import shlex

import optuna
import pytest
import yaml

from optimizer.cli.main import main
from optimizer.core.errors import OptimizerError
from optimizer.decision.export import allocator_line, export_all, serve_args, serve_launcher
from optimizer.hardware.machine import GLIBC, study_allocator
from optimizer.search.attrs import BASELINE, BASELINE_NOTE
from optimizer.search.confirmed import recommended
from tests.support import synthetic


EXPECTED_ARGS = {  # trial #2 of the synthetic study, with the fixed engine args and dummy weights
    "enforce_eager": True, "load_format": "dummy", "max_num_seqs": 128, "max_num_batched_tokens": 2048,
    "gpu_memory_utilization": 0.9, "enable_chunked_prefill": True,
}


def test_export_writes_every_format_from_the_same_arguments(syn):
    study, config, tmp_path = syn
    trial = recommended(study)
    assert trial.number == 2
    done = export_all(trial, config, tmp_path / "out", config.model)
    args = serve_args(trial, config, config.model)
    assert args == {"model": config.model, **EXPECTED_ARGS}

    assert done.command.startswith(shlex.join(serve_launcher())) and "--max-num-seqs 128" in done.command
    assert f" {config.model} " in done.command
    assert yaml.safe_load(done.yaml_path.read_text()) == {k.replace("_", "-"): v for k, v in args.items()}

    doc = json.loads(done.json_path.read_text())
    assert doc["engine_args"] == args
    meta = doc["metadata"]
    assert meta["slo"] == {"limits": {"items": [{"metric": "ttft", "stat": "p99", "value_ms": 100.0}],
                                      "goodput_pct": None}, "text": "TTFT P99 <= 100ms"} and meta["trial"] == 2
    assert meta["workload"]["num_requests"] == 40 and meta["workload"]["arrivals"] == "poisson"
    assert meta["measured"]["output_throughput_tok_s"] == pytest.approx(770)

    text = done.compose_path.read_text()
    service = yaml.safe_load(text)["services"]["vllm"]
    assert service["entrypoint"] == ["vllm", "serve"]
    assert service["command"][0] == config.model
    assert service["command"][service["command"].index("--max-num-seqs") + 1] == "128"
    assert "--enable-chunked-prefill" in service["command"]
    assert service["labels"]["optimize.slo.ttft_p99_ms"] == "100.0"
    assert service["labels"]["optimize.measured.output_throughput_tok_s"] == "770.00"
    assert service["labels"]["optimize.workload"].startswith("poisson, 40 requests, inputs 64-256")
    assert service["volumes"] == [f"{config.model}:{config.model}:ro"]  # a local model directory is mounted
    assert "deploy" not in service  # measured on the CPU build: no GPU reservation
    for header in (done.yaml_path.read_text(), text):
        assert "# SLO: TTFT P99 <= 100ms." in header and "# Workload: Poisson arrivals, 40 requests" in header
        assert "# Measured: 770.0 output tok/s at 7.70 req/s" in header


def test_a_cuda_study_reserves_a_gpu_in_compose(tmp_path):
    study, config = synthetic.build(tmp_path, device="cuda")
    done = export_all(recommended(study), config, tmp_path, config.model)
    service = yaml.safe_load(done.compose_path.read_text())["services"]["vllm"]
    assert service["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_the_engine_json_builds_vllm_engine_args(syn):
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
    except Exception as exc:  # noqa: BLE001 - a broken vLLM install raises more than ImportError
        pytest.skip(f"vLLM not importable: {exc}")
    study, config, tmp_path = syn
    done = export_all(recommended(study), config, tmp_path, config.model)
    engine_args = AsyncEngineArgs(**json.loads(done.json_path.read_text())["engine_args"])
    assert engine_args.max_num_seqs == 128 and engine_args.gpu_memory_utilization == 0.9
    assert engine_args.enforce_eager is True and engine_args.model == config.model


def test_export_names_what_it_wrote_and_refuses_a_study_with_no_feasible_trial(syn):
    study, config, tmp_path = syn
    done = export_all(recommended(study), config, tmp_path, config.model)
    assert done.command.startswith(shlex.join(serve_launcher())) and done.yaml_path == tmp_path / "syn.recommended.yaml"
    assert done.yaml_path.is_file() and done.json_path.is_file() and done.compose_path.is_file()
    with pytest.raises(OptimizerError, match="Relax the limit"):
        export_all(None, config, tmp_path / "none", config.model)
    assert not (tmp_path / "none").exists() or not any((tmp_path / "none").iterdir())  # nothing half-written


def test_cli_export_prints_the_command_and_names_every_file(syn, capsys):
    _, _, tmp_path = syn
    rc = main(["export", "--study", "syn", "--studies-dir", str(tmp_path), "--out", str(tmp_path / "x")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.startswith(shlex.join(serve_launcher()) + " ")
    for name in ("syn.recommended.yaml", "syn.engine_args.json", "syn.compose.yaml"):
        assert (tmp_path / "x" / name).exists() and name in err


def test_the_exported_compose_listens_on_loopback_and_takes_an_api_key_from_the_environment(syn):
    from tests.repo.test_docker_files import interpolate

    study, config, tmp_path = syn
    done = export_all(recommended(study), config, tmp_path, config.model)
    text = done.compose_path.read_text()
    service = yaml.safe_load(text)["services"]["vllm"]
    # as compose resolves it: loopback unless the deployer names an address
    assert interpolate(service["ports"], {}) == ["127.0.0.1:8000:8000"]
    assert interpolate(service["ports"], {"VLLM_BIND_ADDRESS": "0.0.0.0"}) == ["0.0.0.0:8000:8000"]
    assert all(not p.startswith("8000") for p in interpolate(service["ports"], {}))
    # a bare name in `environment` passes the host's value through when it is set, and nothing when it is not
    assert service["environment"] == ["VLLM_API_KEY"]
    assert "--api-key" not in service["command"]  # the key never sits in the file
    assert "set VLLM_API_KEY" in text and "127.0.0.1:8000 only" in text


def test_vllm_serve_reads_the_api_key_variable_the_compose_passes():
    try:
        import vllm.envs as envs
    except Exception as exc:  # noqa: BLE001 - a broken vLLM install raises more than ImportError
        pytest.skip(f"vLLM not importable: {exc}")
    import os

    old = os.environ.get("VLLM_API_KEY")
    os.environ["VLLM_API_KEY"] = "k-123"
    try:
        assert envs.VLLM_API_KEY == "k-123"
    finally:
        if old is None:
            del os.environ["VLLM_API_KEY"]
        else:
            os.environ["VLLM_API_KEY"] = old


FALLBACK_NOTE = synthetic.FALLBACK_NOTE


def _baseline_that_needed_the_fallback(study):
    """Trial #0 of the synthetic study as a CPU machine runs it when vLLM's default memory fraction does not fit."""
    t = study.trials[0]
    attrs = {**t.user_attrs, "engine_config": {**t.user_attrs["engine_config"], "gpu_memory_utilization": 0.3},
             **BASELINE_NOTE.item(FALLBACK_NOTE)}
    trial = optuna.trial.create_trial(values=t.values, params=t.params, distributions=t.distributions,
                                      user_attrs=attrs)
    trial.number = t.number
    return trial


def test_a_baseline_that_needed_this_machines_fallback_is_not_presented_as_tuned(syn, capsys):
    study, config, tmp_path = syn
    trial = _baseline_that_needed_the_fallback(study)
    assert BASELINE.of(trial) and BASELINE_NOTE.of(trial) == FALLBACK_NOTE
    done = export_all(trial, config, tmp_path / "out", config.model)
    assert "--gpu-memory-utilization 0.3" in done.command  # what ran here, and what runs here
    for text in (done.yaml_path.read_text(), done.compose_path.read_text()):
        header = [line for line in text.splitlines() if line.startswith("#")]
        assert "# This is the baseline, vLLM's defaults as the study ran them: nothing here was tuned." in header
        fallback = next(line for line in header if "gpu_memory_utilization 0.3" in line)
        assert fallback.startswith("# Not tuned: ") and "this machine's fallback" in fallback
        assert "does not fit on this CPU machine" in fallback and "leave it out" in fallback
        assert any(line.startswith("# Not tuned, the same in every trial: enforce_eager=True (the CPU build's "
                                   "setting), load_format=dummy (--dummy-weights)") for line in header), header
    meta = json.loads(done.json_path.read_text())["metadata"]
    assert meta["baseline"] is True and meta["machine_fallback"] == FALLBACK_NOTE
    assert meta["fixed_engine_args"] == {"enforce_eager": True, "load_format": "dummy"}
    assert any("this machine's fallback" in note for note in done.notes)


def test_a_tuned_trial_carries_no_fallback_note(syn):
    study, config, tmp_path = syn
    done = export_all(recommended(study), config, tmp_path / "out", config.model)
    text = done.yaml_path.read_text()
    assert "fallback" not in text and "This is the baseline" not in text
    assert "# Not tuned, the same in every trial: enforce_eager=True" in text
    assert json.loads(done.json_path.read_text())["metadata"]["machine_fallback"] is None


def test_a_cpu_export_says_to_serve_on_the_tcmalloc_its_engines_ran_on(syn, tmp_path, monkeypatch):
    study, config, _ = syn
    monkeypatch.setattr("optimizer.decision.export.find_tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    done = export_all(recommended(study), config, tmp_path / "out", config.model)
    assert config.device == "cpu"
    line = next(n for n in done.notes if "LD_PRELOAD=" in n)  # printed by `optimize export`, and in the YAML
    assert "LD_PRELOAD=libtcmalloc_minimal.so.4" in line and line in done.yaml_path.read_text()
    assert "LD_PRELOAD" not in done.command  # the command stays what vLLM's parser reads; the compose image has its own
    monkeypatch.setattr("optimizer.decision.export.allocator_here", lambda: "glibc")  # engines on glibc: nothing to say
    plain = export_all(recommended(study), config, tmp_path / "o2", config.model)
    assert not any("LD_PRELOAD" in n for n in plain.notes)
    (tmp_path / "gpu").mkdir()
    gpu_study, gpu = synthetic.build(tmp_path / "gpu", device="cuda")
    assert not any("LD_PRELOAD" in n for n in export_all(recommended(gpu_study), gpu, tmp_path / "o3", gpu.model).notes)


def test_the_export_reads_the_allocator_from_the_studys_fingerprint_not_the_exporting_machine(syn, tmp_path,
                                                                                              monkeypatch):
    study, config, _ = syn
    trial = recommended(study)
    monkeypatch.setattr("optimizer.decision.export.find_tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    monkeypatch.setattr("optimizer.decision.export.allocator_here", lambda: "tcmalloc")
    glibc_study = {"cpu_model": "Xeon", "gpus": [], "cores": 2}  # stored before the allocator was: glibc ran
    assert not any("LD_PRELOAD" in n for n in export_all(trial, config, tmp_path / "a", config.model,
                                                         machine=glibc_study).notes)
    monkeypatch.setattr("optimizer.decision.export.find_tcmalloc", lambda: None)  # exported where none is installed
    monkeypatch.setattr("optimizer.decision.export.allocator_here", lambda: "glibc")
    tcmalloc_study = {**glibc_study, "allocator": "tcmalloc"}
    notes = export_all(trial, config, tmp_path / "b", config.model, machine=tcmalloc_study).notes
    assert any("LD_PRELOAD=libtcmalloc_minimal.so.4" in n for n in notes)  # the study ran on it: Debian's soname
    assert not any("LD_PRELOAD" in n for n in export_all(trial, config, tmp_path / "c", config.model).notes)


def test_a_study_made_before_fingerprints_named_the_allocator_ran_on_glibc():
    assert study_allocator({"gpus": [], "cores": 2}, here="tcmalloc") == GLIBC
    assert study_allocator({"gpus": [], "allocator": "jemalloc"}, here="tcmalloc") == "jemalloc"
    assert study_allocator(None, here="tcmalloc") == "tcmalloc"  # nothing stored: the machine exporting it
    assert allocator_line("cpu", "jemalloc", "libtcmalloc_minimal.so.4") is None  # a preload of the user's own
    assert allocator_line("cuda", "tcmalloc", "libtcmalloc_minimal.so.4") is None



def test_a_searched_fp8_kv_cache_is_exported_with_the_accuracy_check_it_did_not_get(syn):
    """An fp8 KV cache the search chose changes what the model computes; the study measured speed with token ids. The
    export says so (printed by `optimize export` and in every file's header); one the user fixed is theirs."""
    study, config, tmp_path = syn
    t = recommended(study)
    kv = optuna.distributions.CategoricalDistribution(["auto", "fp8"])
    ran = {**t.user_attrs.get("engine_params", {}), "kv_cache_dtype": "fp8"}
    fp8 = optuna.trial.create_trial(values=t.values, params={**t.params, "kv_cache_dtype": "fp8"},
                                    distributions={**t.distributions, "kv_cache_dtype": kv},
                                    user_attrs={**t.user_attrs, "engine_params": ran})
    fp8.number = t.number
    done = export_all(fp8, config, tmp_path / "out", config.model)
    line = next(n for n in done.notes if n.startswith("Not checked: kv_cache_dtype=fp8"))
    assert "accuracy" in line and "--kv-cache-dtype fp8" in done.command
    for path in (done.yaml_path, done.compose_path):
        assert f"# {line}" in path.read_text()
    assert not any("Not checked" in n for n in export_all(t, config, tmp_path / "plain", config.model).notes)
    fixed = config.model_copy(update={"engine_args": {**config.engine_args, "kv_cache_dtype": "fp8"}})
    assert not any("Not checked" in n for n in export_all(t, fixed, tmp_path / "fixed", config.model).notes)


def test_the_compose_runs_the_vllm_version_measured_and_a_hub_model_from_the_host_s_cache(syn):
    """`latest` ran whatever vLLM was newest, whose defaults (memory fraction, batch limits, async scheduling) may
    not be the ones measured; a hub model was downloaded again on every `up`, and a gated one failed."""
    from tests.repo.test_docker_files import interpolate

    study, config, tmp_path = syn
    done = export_all(recommended(study), config, tmp_path / "hub", "meta-llama/Llama-3.1-8B-Instruct",
                      machine={"vllm": "0.32.0+cu129"})
    service = yaml.safe_load(done.compose_path.read_text())["services"]["vllm"]
    assert interpolate(service["image"], {}) == "vllm/vllm-openai:v0.32.0"
    assert interpolate(service["image"], {"VLLM_IMAGE": "mine:1"}) == "mine:1"
    cache = ["/home/u/.cache/huggingface:/root/.cache/huggingface"]
    assert interpolate(service["volumes"], {"HOME": "/home/u"}) == cache
    assert service["environment"] == ["VLLM_API_KEY", "HF_TOKEN"]  # passed through when set, never written down
    unknown = export_all(recommended(study), config, tmp_path / "old", config.model, machine={})
    image = yaml.safe_load(unknown.compose_path.read_text())["services"]["vllm"]["image"]
    assert interpolate(image, {}) == "vllm/vllm-openai:latest"  # a study that did not record its vLLM
    from optimizer.decision.compose import image as image_of

    assert image_of("0.33.0rc1") == image_of("0.32.1.dev3+g1234") == "vllm/vllm-openai:latest"  # no such tag
    assert image_of("0.10.1.1") == "vllm/vllm-openai:v0.10.1.1"


def test_a_block_size_vllm_chose_for_its_gpu_is_left_to_vllm_where_the_study_did_not_choose_it(syn):
    """An MLA model's space leaves block_size to vLLM (FlashMLA took 64 on the GPU measured); exported, that 64 would
    turn away CUTLASS MLA (128) and FlashInfer MLA (32) on the GPU deployed. A searched or fixed one is exported."""
    study, config, tmp_path = syn
    trial = recommended(study)
    trial.user_attrs["engine_config"] = {**trial.user_attrs["engine_config"], "block_size": 64}
    assert "block_size" not in serve_args(trial, config, config.model)
    trial.user_attrs["engine_params"] = {**trial.user_attrs["engine_params"], "block_size": 64}
    assert serve_args(trial, config, config.model)["block_size"] == 64
    trial.user_attrs["engine_params"] = {k: v for k, v in trial.user_attrs["engine_params"].items()
                                         if k != "block_size"}
    fixed = config.model_copy(update={"engine_args": {**config.engine_args, "block_size": 64}})
    assert serve_args(trial, fixed, config.model)["block_size"] == 64


def test_a_two_limit_study_exports_both_limits_and_what_bound_it(two_limits):
    """Tuned for TTFT P99 <= 100ms and TPOT P99 <= 50ms: the header, the JSON's `slo` and the compose labels name
    both, the measured line gives each limit's statistic, and the limit that stopped a higher rate (TPOT)."""
    from optimizer.decision.decide import decide

    study, config, tmp_path = two_limits
    d = decide(study, config)
    done = export_all(d.best.trial, config, tmp_path / "out", config.model)
    header = done.yaml_path.read_text()
    assert "# SLO: TTFT P99 <= 100ms, TPOT P99 <= 50ms." in header
    assert ("# Measured: 500.0 output tok/s at 5.00 req/s, TTFT P99 50ms, TPOT P99 40ms. Bound by TPOT P99 61 ms > "
            "50 ms at 6.0 req/s.") in header
    slo = json.loads(done.json_path.read_text())["metadata"]["slo"]
    assert slo == {"limits": {"items": [{"metric": "ttft", "stat": "p99", "value_ms": 100.0},
                                        {"metric": "tpot", "stat": "p99", "value_ms": 50.0}], "goodput_pct": None},
                   "text": "TTFT P99 <= 100ms, TPOT P99 <= 50ms"}
    labels = yaml.safe_load(done.compose_path.read_text())["services"]["vllm"]["labels"]
    assert labels["optimize.slo.ttft_p99_ms"] == "100.0" and labels["optimize.slo.tpot_p99_ms"] == "50.0"
    assert labels["optimize.slo"] == "TTFT P99 <= 100ms, TPOT P99 <= 50ms"
    with pytest.raises(OptimizerError, match=r"meets TTFT P99 <= 100ms, TPOT P99 <= 50ms: nothing to export\. Relax "
                                             r"the limits \(--ttft-p99 100ms --tpot-p99 50ms\)"):
        export_all(None, config, tmp_path / "none", config.model)
