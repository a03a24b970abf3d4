"""GPU telemetry through a scripted NVML (hand-checked means and maxima), and cleanly unavailable here."""

import time

import pytest

from optimizer.measurement.telemetry import GIB, GpuTelemetry, device_handle, for_device
from tests.support.fake_nvml import FakeNvml as SharedFakeNvml


def FakeNvml(script, name="NVIDIA H200", total=140 * GIB, fail_init=False, devices=2):
    """NVML scripted with NVML's own return types (tests/support/fake_nvml.py); an empty script: the GPU is lost after
    the one reading `open()` makes."""
    return SharedFakeNvml(devices=[(name, total, (9, 0))] * devices, script=script or [(0, 0)],
                          fail_init=fail_init, lost_after_readings=1 if not script else None)


def test_summary_of_scripted_samples():
    nvml = FakeNvml([(0, 10 * GIB), (50, 30 * GIB), (100, 20 * GIB)])
    t = GpuTelemetry(nvml=nvml)
    assert t.open()
    nvml.readings = 0  # open() read the total once
    for _ in range(3):
        t.sample()
    t.close()
    s = t.summary()
    assert s["available"] and s["device"] == "NVIDIA H200" and s["samples"] == 3
    assert s["utilization_mean_pct"] == 50.0 and s["utilization_max_pct"] == 100.0  # (0 + 50 + 100) / 3
    assert s["memory_used_max_gib"] == 30.0 and s["memory_total_gib"] == 140.0
    assert nvml.shutdowns == 1


def test_sampling_thread_samples_until_the_block_ends():
    nvml = FakeNvml([(40, 8 * GIB)])
    with GpuTelemetry(nvml=nvml, interval_s=0.01) as t:
        time.sleep(0.1)
    s = t.summary()
    assert s["available"] and s["samples"] >= 2 and s["utilization_mean_pct"] == 40.0
    assert nvml.inits == 1 and nvml.shutdowns == 1


def test_failed_readings_are_counted_not_raised():
    nvml = FakeNvml([])
    with GpuTelemetry(nvml=nvml, interval_s=0.01) as t:
        time.sleep(0.05)
    s = t.summary()
    assert s == {"available": False, "reason": "no sample succeeded"}


def test_no_nvml_is_recorded_as_unavailable():
    with GpuTelemetry(nvml=FakeNvml([], fail_init=True)) as t:
        pass
    assert t.summary() == {"available": False,
                           "reason": "NVML unavailable: NVMLError_LibraryNotFound: NVML Shared Library Not Found"}


def test_cpu_trials_record_no_gpu_telemetry():
    with for_device("cpu", FakeNvml([(1, 1)])) as t:
        pass
    assert t.summary() == {"available": False, "reason": "trials run on cpu: no GPU telemetry"}


def test_the_real_nvml_on_this_machine_reports_cleanly():
    """Here there is no GPU: the real pynvml must give `available: false` with a reason, never an exception."""
    pynvml = pytest.importorskip("pynvml")
    with for_device("cuda", pynvml, interval_s=0.05) as t:
        time.sleep(0.1)
    s = t.summary()
    if s["available"]:  # a GPU host: real samples
        assert s["samples"] >= 1 and s["device"]
    else:
        assert s["reason"].startswith(("NVML unavailable", "no GPU visible"))


@pytest.mark.parametrize("visible, expected", [(None, 0), ("1,0", 1), ("0", 0),
                                               (f"{SharedFakeNvml.uuid(1)},{SharedFakeNvml.uuid(0)}", 1),
                                               (SharedFakeNvml.uuid(1)[:12], 1)])
def test_the_device_is_the_first_visible_one(monkeypatch, visible, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    nvml = FakeNvml([(0, 0)])
    nvml.nvmlInit()
    assert nvml.nvmlDeviceGetUUID(device_handle(nvml)) == SharedFakeNvml.uuid(expected)


def test_a_mig_instance_is_watched_by_its_uuid_memory_without_utilization(monkeypatch):
    """The first MIG instance listed is the one CUDA gives the process; NVML reads its memory, not its utilization
    (NOT_SUPPORTED on MIG-enabled GPUs): the trial keeps the memory and says why it has no utilization, rather than
    failing every sample and recording no telemetry at all."""
    nvml = SharedFakeNvml(devices=[("NVIDIA A100-SXM4-80GB", 80 * GIB, (8, 0))] * 2,
                          script=[(0, 3 * GIB), (0, 5 * GIB)], migs=[(1, "NVIDIA A100-SXM4-80GB MIG 1g.10gb", 10 * GIB),
                                (1, "NVIDIA A100-SXM4-80GB MIG 3g.40gb", 40 * GIB)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{SharedFakeNvml.mig_uuid(1)},{SharedFakeNvml.mig_uuid(0)}")
    t = GpuTelemetry(nvml=nvml)
    assert t.open() and t.device_name == "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    nvml.readings = 0
    t.sample()
    t.sample()
    t.close()
    s = t.summary()
    assert s["available"] and s["samples"] == 2 and s["sample_errors"] == 0
    assert s["memory_used_max_gib"] == 5.0 and s["memory_total_gib"] == 40.0  # the instance's, not the GPU's 80
    assert s["utilization_mean_pct"] is None and s["utilization"].startswith("not read")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{SharedFakeNvml.mig_uuid(1)},{SharedFakeNvml.mig_uuid(1)}")
    with pytest.raises(LookupError, match="twice"):  # a list naming an instance twice names none
        nvml.nvmlInit()
        device_handle(nvml)


@pytest.mark.parametrize("visible", ["", "-1", "2", "0,0"])
def test_no_device_is_watched_where_cuda_would_see_none(monkeypatch, visible):
    """CUDA_VISIBLE_DEVICES="" hides every GPU (on an H200 too, benchmarks/gpu_host.py): watching GPU 0 anyway
    would report another process's GPU as this trial's."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    nvml = FakeNvml([(0, 0)])
    t = GpuTelemetry(nvml=nvml)
    assert not t.open()
    assert t.summary() == {"available": False, "reason": t.reason}
    assert t.reason.startswith("no GPU visible to NVML: LookupError") and nvml.shutdowns == 1
