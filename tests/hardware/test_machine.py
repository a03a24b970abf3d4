"""The machine: CPU flags -> native bf16 -> the dtype served; the fingerprint stored with studies and calibrations."""

import json

import pytest

from optimizer.cli.main import main
from optimizer.config.model import DEFAULT_MODEL_CONFIG, model_info
from optimizer.config.settings import StudyConfig
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.hardware.machine import (
    ASSUME_NO_NATIVE_BF16_ENV, CpuInfo, choose_dtype, cpu_info, describe, differences, engine_allocator, fingerprint,
    parse_cpuinfo,
)
from optimizer.params.preflight import GIB, DeviceMemory, estimate
from optimizer.search.attrs import STUDY_MACHINE
from optimizer.search.fitting import cpu_engine_args, machine_warning, served_dtype

XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme avx2 avx512f avx512_bf16 amx_bf16 amx_tile
processor\t: 1
model name\t: ignored second core
flags\t\t: fpu
"""
EPYC = """processor\t: 0
model name\t: AMD EPYC 7B12
flags\t\t: fpu avx avx2 fma
"""
GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes sve bf16 i8mm
CPU implementer\t: 0x41
"""
GRAVITON2 = """processor\t: 0
Features\t: fp asimd evtstrm aes
"""


@pytest.mark.parametrize("text,arch,native", [
    (XEON, "x86_64", True), (EPYC, "x86_64", False), (GRAVITON3, "aarch64", True), (GRAVITON2, "aarch64", False),
])
def test_native_bf16_from_the_flags(text, arch, native):
    cpu = parse_cpuinfo(text, arch)
    assert cpu.native_bf16 is native


def test_cpuinfo_reads_the_first_processor():
    cpu = parse_cpuinfo(XEON, "x86_64")
    assert cpu.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert {"avx512_bf16", "amx_bf16"} <= cpu.flags and "fpu" in cpu.flags


def test_arm_bf16_is_not_read_from_x86_flags():
    # an x86 CPU whose flag list happened to hold a bare "bf16" is still judged by avx512_bf16 / amx_bf16
    assert not CpuInfo("x", frozenset({"bf16", "avx2"}), "x86_64").native_bf16


def test_float32_for_a_half_model_on_a_cpu_without_native_bf16():
    epyc, xeon = parse_cpuinfo(EPYC, "x86_64"), parse_cpuinfo(XEON, "x86_64")
    slow = choose_dtype("bfloat16", "cpu", epyc)
    assert slow.dtype == "float32" and "no avx512_bf16 or amx_bf16" in slow.reason
    assert choose_dtype("float16", "cpu", epyc).dtype == "float32"
    assert choose_dtype("bfloat16", "cpu", xeon).dtype is None  # the model's own
    # vLLM's dtype auto serves a float32 model in bfloat16 (x86 CPUs, GPUs): emulated on the EPYC, so float32 there
    full = choose_dtype("float32", "cpu", epyc)
    assert full.dtype == "float32" and "vLLM would serve in bfloat16" in full.reason
    native = choose_dtype("float32", "cpu", xeon)
    assert native.dtype is None and native.reason.startswith("bfloat16, as vLLM serves a float32 model")
    assert choose_dtype("float32", "cuda", epyc).dtype is None
    assert choose_dtype("bfloat16", "cuda", epyc).dtype is None  # a GPU computes bf16 whatever the host CPU


def test_the_testing_setting_treats_bf16_as_not_native(monkeypatch):
    monkeypatch.setenv(ASSUME_NO_NATIVE_BF16_ENV, "1")
    assert not cpu_info().native_bf16
    assert cpu_engine_args("bfloat16") == {"enforce_eager": True, "dtype": "float32"}
    monkeypatch.setenv(ASSUME_NO_NATIVE_BF16_ENV, "0")
    assert cpu_info().native_bf16 == parse_cpuinfo(open("/proc/cpuinfo").read(), cpu_info().arch).native_bf16


def _config(tmp_path, **kw):
    return StudyConfig(**{"study_name": "s", "storage_url": f"sqlite:///{tmp_path}/s.db", "ttft_p99_ms": 150.0,
                          "budget": 3, "model": "m", "device": "cpu", **kw})


def test_served_dtype_is_float32_without_native_bf16_and_the_users_choice_wins(tmp_path, monkeypatch):
    monkeypatch.setenv(ASSUME_NO_NATIVE_BF16_ENV, "1")
    config, line = served_dtype(_config(tmp_path, engine_args={"enforce_eager": True}), "bfloat16")
    assert config.engine_args == {"enforce_eager": True, "dtype": "float32"}
    assert line.startswith("dtype: float32: the model is bfloat16, but this CPU has no")
    fixed = _config(tmp_path, space={"fixed": {"dtype": "bfloat16"}})
    config, line = served_dtype(fixed, "bfloat16")
    assert "dtype" not in config.engine_args and line == "dtype: bfloat16 (given in --space)"
    searched = _config(tmp_path, space={"ranges": {"dtype": {"choices": ["bfloat16", "float32"]}}})
    config, line = served_dtype(searched, "bfloat16")
    assert "dtype" not in config.engine_args and "searched over" in line


def test_preflight_counts_the_bytes_of_the_dtype_served():
    info = model_info({**DEFAULT_MODEL_CONFIG, "torch_dtype": "bfloat16"}, "m", weights_bytes=1 * GIB)
    as_fp32 = info.served_as("float32")
    assert as_fp32.weights_bytes == 2 * GIB and as_fp32.kv_bytes_per_token == 2 * info.kv_bytes_per_token
    assert info.served_as(None) is info and info.served_as("auto") is info
    memory = DeviceMemory(total_bytes=24 * GIB, available_bytes=24 * GIB)
    half = estimate({"gpu_memory_utilization": 0.2, "max_model_len": 1024}, info, "cpu", memory, 200)
    full = estimate({"gpu_memory_utilization": 0.2, "max_model_len": 1024, "dtype": "float32"}, info, "cpu",
                    memory, 200)
    assert full.weights_bytes == 2 * half.weights_bytes
    assert full.kv_one_sequence_bytes == 2 * half.kv_one_sequence_bytes


def test_fingerprint_and_differences():
    here = fingerprint("cpu")
    assert here["cores"] >= 1 and here["vllm"] and here["torch"] and here["gpus"] == []
    assert differences(here, dict(here)) == []
    other = {**here, "cpu_model": "AMD EPYC 7B12", "native_bf16": False, "cores": 64}
    diffs = differences(other, here)  # bf16 differs only where this CPU (or OPTIMIZER_ASSUME_NO_NATIVE_BF16) says native
    assert f"cpu_model: AMD EPYC 7B12 -> {here['cpu_model']}" in diffs
    assert len(diffs) == 1 + (here["cores"] != 64) + bool(here["native_bf16"])
    assert "no native bf16" in describe(other) and "64 cores" in describe(other)


@pytest.mark.parametrize("ld_preload, tcmalloc, allocator", [
    ("", "libtcmalloc_minimal.so.4", "tcmalloc"),  # found: the engines preload it (optimizer/engines/allocator.py)
    ("/torch/lib/libgomp.so.1", None, "glibc"),  # none found, none preloaded
    ("/usr/lib/libjemalloc.so.2:/torch/lib/libgomp.so.1", "libtcmalloc_minimal.so.4", "jemalloc"),  # the user's
])
def test_the_engine_allocator_is_the_preloaded_one_else_a_found_tcmalloc_else_glibc(ld_preload, tcmalloc, allocator):
    assert engine_allocator(ld_preload, tcmalloc) == allocator


def test_a_cpu_fingerprint_names_its_allocator_and_one_stored_before_it_was_ran_on_glibc():
    here = fingerprint("cpu")
    assert here["allocator"] in ("tcmalloc", "jemalloc", "mimalloc", "glibc")
    assert f"malloc: {here['allocator']}" in describe(here)
    before = {k: v for k, v in here.items() if k != "allocator"}  # a study stored without an allocator
    assert differences(before, {**here, "allocator": "glibc"}) == []
    assert differences(before, {**here, "allocator": "tcmalloc"}) == ["allocator: glibc -> tcmalloc"]
    assert differences({**here, "allocator": "tcmalloc"}, {**here, "allocator": "glibc"}) == [
        "allocator: tcmalloc -> glibc"]


def test_gpus_read_through_nvml():
    from optimizer.hardware.machine import gpus
    from tests.support.fake_nvml import GIB, FakeNvml

    nvml = FakeNvml(devices=(("NVIDIA H100 80GB HBM3", 80 * GIB, (9, 0)),) * 2)
    h100 = {"name": "NVIDIA H100 80GB HBM3", "memory_gib": 80.0, "compute_capability": "9.0", "driver": "550.54.15"}
    assert gpus(nvml) == [h100, h100]
    assert nvml.initialized == 0  # every NVML session closed again
    assert gpus(FakeNvml(fail_init=True)) == []
    assert "NVIDIA H100 80GB HBM3 80.0 GiB (driver 550.54.15)" in describe({**fingerprint("cpu"), "gpus": [h100]})


def test_a_resume_on_another_machine_warns(tmp_path, monkeypatch):
    here = fingerprint("cpu")
    assert machine_warning(here, "cpu") is None
    assert machine_warning(None, "cpu") is None  # a study made before machines were stored
    line = machine_warning({**here, "cpu_model": "AMD EPYC 7B12"}, "cpu")
    assert line.startswith("warning: this study was created on another machine") and "AMD EPYC 7B12" in line


def test_the_study_stores_its_machine_and_a_resume_elsewhere_says_so(tmp_path, monkeypatch, config_only_model):
    from tests.support.fakes import SimEngine

    from optimizer.search.runner import prepare, run

    config = StudyConfig(study_name="s", storage_url=f"sqlite:///{tmp_path}/s.db", ttft_p99_ms=30.0, budget=1,
                         model=str(config_only_model), dummy_weights=True, device="cpu",
                         workload=WorkloadSpec(num_requests=20, warmup_requests=1, input_len_min=16,
                                               input_len_max=64, output_len_min=2, output_len_max=4))
    said: list[str] = []
    prepared = prepare(config, tmp_path, say=said.append, engine_factory=SimEngine, memory_probe=lambda: None)
    run(prepared, quiet=True)
    stored = STUDY_MACHINE.of(prepared.study)
    assert stored == fingerprint("cpu") and any(s.startswith("machine: ") for s in said)
    # the same study resumed on an AVX2-only EPYC
    import optimizer.hardware.machine

    monkeypatch.setattr(optimizer.hardware.machine, "cpu_info", lambda: parse_cpuinfo(EPYC, "x86_64"))
    said.clear()
    again = prepare(prepared.config.model_copy(update={"budget": 2}), tmp_path, say=said.append,
                    engine_factory=SimEngine, memory_probe=lambda: None)
    warnings = [s for s in said if s.startswith("warning: this study was created on another machine")]
    assert len(warnings) == 1 and "cpu_model: " in warnings[0] and "-> AMD EPYC 7B12" in warnings[0]
    assert STUDY_MACHINE.of(again.study) == stored  # the study keeps the machine it was made on
    assert again.config.engine_args == prepared.config.engine_args  # and its dtype: a resume changes neither


def test_a_calibration_from_another_machine_is_refused(tmp_path, capsys):
    from optimizer.engines.sim.steptime import StepTimeModel

    cal = tmp_path / "cal.json"
    StepTimeModel().save(cal)
    data = json.loads(cal.read_text())
    cal.write_text(json.dumps({**data, "machine": {**fingerprint("cpu"), "cpu_model": "AMD EPYC 7B12", "cores": 64}}))
    argv = ["--ttft-p99", "150ms", "--prescreen", "5", "--calibration", str(cal), "--device", "cpu",
            "--studies-dir", str(tmp_path / "studies")]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "was made on another machine" in err and "optimize calibrate" in err
    assert "--force-calibration" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "studies").exists()
    # the same machine's calibration passes that check (the study then fails later for want of --model here)
    cal.write_text(json.dumps({**data, "machine": fingerprint("cpu")}))
    from optimizer.cli.run import build_parser, explicit_settings

    assert explicit_settings(build_parser().parse_args(argv))["calibration"] == str(cal.resolve())
    cal.write_text(json.dumps({**data, "machine": {**fingerprint("cpu"), "cpu_model": "other"}}))
    forced = explicit_settings(build_parser().parse_args([*argv, "--force-calibration"]))
    assert forced["calibration"] == str(cal.resolve())


def test_dtype_can_be_searched_on_cpu():
    import optuna

    from optimizer.params.space import parse_space_yaml, resolve

    space = resolve(parse_space_yaml({"dtype": ["bfloat16", "float32"]}), "cpu", 2048, WorkloadSpec())
    seen = set()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(12):
        trial = study.ask()
        seen.add(space.suggest(trial)["dtype"])
        study.tell(trial, 0.0)
    assert seen == {"bfloat16", "float32"}
