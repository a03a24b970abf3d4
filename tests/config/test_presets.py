"""Named workload presets, `--preset` and `preset:` in the workload YAML, and closed-loop studies."""

import json

import optuna
import pytest

from optimizer.cli.main import main
from optimizer.cli.run import build_parser, resolve_config
from optimizer.config.model import DEFAULT_MODEL_CONFIG
from optimizer.config.presets import PRESETS, demo_workload, get
from optimizer.config.settings import StudyConfig, build
from optimizer.config.workload_spec import CPU_DEMO_WORKLOAD, WorkloadSpec
from optimizer.core.errors import UsageError
from tests.support.fake_engine import FakeEngine
from optimizer.measurement.workload import build_workload
from optimizer.search.runner import prepare, run


def resolve(tmp_path, *argv):
    return resolve_config(build_parser().parse_args([*argv, "--studies-dir", str(tmp_path)]))[0]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_valid_at_both_scales_and_the_demo_fits_the_embedded_model(name):
    p = PRESETS[name]
    assert set(p.fields) == set(p.cpu_demo)  # the demo scale replaces every field: nothing of the GPU scale leaks
    full, demo = WorkloadSpec(preset=name), WorkloadSpec(**demo_workload({"preset": name}, CPU_DEMO_WORKLOAD))
    assert demo.preset == name and full.preset == name
    assert demo.max_total_len <= DEFAULT_MODEL_CONFIG["max_position_embeddings"]
    assert demo.mean_total_len <= full.mean_total_len
    assert len(build_workload(demo, 16000).requests) == demo.num_requests


def test_presets_differ_where_their_traffic_does():
    rag, batch, bursty, chat = (WorkloadSpec(preset=n) for n in ("rag", "batch", "bursty", "chat"))
    assert rag.prefix_fraction > 0 and rag.max_total_len > chat.max_total_len
    assert batch.output_components()[0][1].expected() > 3 * chat.output_components()[0][1].expected()
    assert bursty.burstiness < 1 and chat.burstiness == 1
    rag_requests = build_workload(rag, 32000).requests
    assert sum(r.prefix_group is not None for r in rag_requests) == round(0.7 * len(rag_requests))


def test_fields_given_beside_a_preset_win():
    s = build(WorkloadSpec, {"preset": "chat", "num_requests": 50, "input_len_max": 1000}, "workload")
    assert s.num_requests == 50 and s.input_len_max == 1000 and s.input_len_dist == "lognormal"
    assert s.output_len_mean == PRESETS["chat"].fields["output_len_mean"]


def test_a_uniform_range_over_a_lognormal_preset_drops_its_mean_and_std():
    s = build(WorkloadSpec, {"preset": "batch", "output_len_dist": "uniform", "output_len_min": 10,
                             "output_len_max": 20}, "workload")
    assert (s.output_len_dist, s.output_len_mean, s.output_len_std) == ("uniform", None, None)
    assert s.max_total_len == PRESETS["batch"].fields["input_len_max"] + 20


def test_unknown_preset_lists_the_names():
    with pytest.raises(UsageError, match="unknown workload preset 'gpt': choose one of chat, rag, batch, bursty"):
        get("gpt")
    with pytest.raises(UsageError, match="unknown preset 'gpt': choose one of chat, rag, batch, bursty"):
        build(WorkloadSpec, {"preset": "gpt"}, "workload")


def test_preset_flag_on_the_cpu_demo_takes_the_demo_scale_and_flags_override(tmp_path):
    config = resolve(tmp_path, "--ttft-p99", "1s", "--preset", "rag", "--num-requests", "60")
    w = config.workload
    assert w.preset == "rag" and w.num_requests == 60
    assert (w.prefix_len, w.input_len_max) == (PRESETS["rag"].cpu_demo["prefix_len"],
                                               PRESETS["rag"].cpu_demo["input_len_max"])
    flat = resolve(tmp_path, "--ttft-p99", "1s", "--preset", "chat", "--input-len", "64:128")
    assert (flat.workload.input_len_dist, flat.workload.input_len_min, flat.workload.input_len_mean) == \
        ("uniform", 64, None)  # MIN:MAX on the command line means uniform


def test_preset_in_the_workload_yaml_at_full_scale_for_a_real_model(tmp_path, config_only_model):
    f = tmp_path / "w.yaml"
    f.write_text("preset: batch\nnum_requests: 40\n")
    config = resolve(tmp_path, "--ttft-p99", "5s", "--model", str(config_only_model), "--dummy-weights",
                     "--workload", str(f))
    assert config.workload.num_requests == 40
    assert config.workload.output_len_max == PRESETS["batch"].fields["output_len_max"]


def test_default_demo_workload_is_unchanged(tmp_path):
    assert resolve(tmp_path, "--ttft-p99", "150ms").workload == WorkloadSpec(**CPU_DEMO_WORKLOAD)


@pytest.mark.parametrize("text,hint", [
    ("preset: gpt\n", "unknown workload preset 'gpt': choose one of chat, rag, batch, bursty"),
    ("input_mixture: [{weight: 0.8, min: 1, max: 9}, {weight: 0.4, min: 1, max: 9}]\n",
     "input_mixture weights sum to 1.2"),
    ("input_len_dist: normal\ninput_len_mean: 100\ninput_len_std: -5\n", "input_len_std must be > 0"),
    ("arrivals: closed_loop\n", "closed_loop needs concurrency"),
    ("num_requests: [\n", "not valid YAML"),
    ("- 1\n- 2\n", "must hold a mapping"),
    ("prefix_len: 64\nprefix_groups: 2\nprefix_fraction: 1.5\n", "prefix_fraction"),
    ("arival: constant\n", "arival"),
])
def test_bad_workload_yaml_is_one_line_and_exit_2(tmp_path, capsys, text, hint):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    out = tmp_path / "studies"
    code = main(["--workload", str(f), "--ttft-p99", "1s", "--studies-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and hint in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_unknown_preset_flag_exits_2(tmp_path, capsys):
    code = main(["--preset", "gpt", "--ttft-p99", "1s", "--studies-dir", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert code == 2 and "choose one of chat, rag, batch, bursty" in err and len(err.strip().splitlines()) == 1


def test_a_study_stored_before_the_new_workload_fields_resumes(tmp_path, config_only_model):
    url = f"sqlite:///{tmp_path}/old.db"
    old_workload = {"num_requests": 120, "warmup_requests": 4, "input_len_min": 32, "input_len_max": 256,
                    "output_len_min": 16, "output_len_max": 64, "seed": 0, "burstiness": 1.0,
                    "long_prompt_fraction": 0.0, "long_input_len_min": None, "long_input_len_max": None,
                    "trace": None}
    old = {"study_name": "old", "storage_url": url, "ttft_p99_ms": 150.0, "budget": 3, "model": str(config_only_model),
           "dummy_weights": True, "device": "cpu", "workload": old_workload}
    study = optuna.create_study(study_name="old", storage=url, directions=["maximize", "minimize"])
    study.set_user_attr("optimizer_config", json.dumps(old))
    config = resolve(tmp_path, "--study", "old", "--storage", url, "--budget", "5", "--input-len", "32:256")
    assert config.budget == 5 and config.workload == WorkloadSpec(**old_workload)


def test_a_closed_loop_study_measures_each_trial_at_its_concurrency(tmp_path, config_only_model):
    workload = WorkloadSpec(num_requests=30, warmup_requests=1, input_len_min=16, input_len_max=64, output_len_min=2,
                            output_len_max=6, arrivals="closed_loop", concurrency=4)
    config = StudyConfig(study_name="c", storage_url=f"sqlite:///{tmp_path}/c.db", ttft_p99_ms=200.0, budget=2,
                         model=str(config_only_model), dummy_weights=True, device="cpu", workload=workload)
    study = run(prepare(config, tmp_path, say=lambda *a: None, engine_factory=FakeEngine, memory_probe=lambda: None),
                quiet=True)
    assert len(study.trials) == 2
    for t in study.trials:
        curve, result = t.user_attrs["curve"], t.user_attrs["result"]
        # one replay at the clients' load, no rate search (the baseline repeats it: the study's noise level)
        assert len(curve) == (3 if t.user_attrs.get("baseline") else 1)
        point = curve[0]
        assert all(p["completed"] == 30 and p["sustained"] for p in curve) and result["feasible"]
        # the point carries the request rate the 4 clients reached, not "burst"; its repeats the same label
        assert point["request_throughput_rps"] > 0
        assert point["offered_rate_rps"] == pytest.approx(point["request_throughput_rps"])
        assert {p["offered_rate_rps"] for p in curve} == {result["rate_rps"]}
        assert t.values[0] > 0
