"""install.sh picks vLLM's build for the machine: `./install.sh --which` prints the line it would print and installs
nothing. Run on a copy of the script with a PATH of only the tools it needs and a fake `nvidia-smi` (or none), and a
fake driver folder in place of /proc/driver/nvidia/gpus, so that the real host's GPUs never decide."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

TOOLS = ("bash", "sh", "dirname", "sed", "sort", "uniq", "paste", "find", "wc")
TWO_H100 = """echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-8a7e1b4c-0000-0000-0000-000000000000)"
echo "  MIG 3g.40gb     Device  0: (UUID: MIG-5c2d9f1a-0000-0000-0000-000000000000)"
echo "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-8a7e1b4d-0000-0000-0000-000000000000)"
"""
# what nvidia-smi prints, exit code 9, where its library finds no driver
NO_DRIVER = """echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver." >&2
exit 9
"""


def which(tmp_path: Path, nvidia_smi: str | None, driver_gpus: int = 0) -> tuple[int, str, str]:
    """Run `install.sh --which` on a copy of the script; `nvidia_smi` is the fake's body (None: no nvidia-smi on
    PATH), `driver_gpus` the entries of the fake driver folder."""
    bin_dir, proc = tmp_path / "bin", tmp_path / "proc"
    bin_dir.mkdir()
    proc.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, f"{tool} is not on this machine's PATH"
        (bin_dir / tool).symlink_to(found)
    if nvidia_smi is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text("#!/bin/sh\n" + nvidia_smi)
        fake.chmod(0o755)
    for i in range(driver_gpus):
        (proc / f"0000:{0x18 + i:02x}:00.0").mkdir()
    script = tmp_path / "repo" / "install.sh"
    script.parent.mkdir()
    shutil.copy(REPO / "install.sh", script)
    done = subprocess.run([str(bin_dir / "bash"), str(script), "--which"], capture_output=True, text=True,
                          env={"PATH": str(bin_dir), "OPTIMIZER_NVIDIA_PROC": str(proc)}, timeout=30)
    assert not (script.parent / ".venv").exists()  # --which installs nothing
    return done.returncode, done.stdout, done.stderr


def test_a_gpu_that_nvidia_smi_lists_installs_the_cuda_build(tmp_path):
    rc, out, err = which(tmp_path, TWO_H100)
    assert (rc, err) == (0, "")
    assert out == ("vLLM build: cuda (nvidia-smi -L lists 2 x NVIDIA H100 80GB HBM3); ./install.sh cpu forces the "
                   "CPU build\n")


def test_nvidia_smi_failing_without_a_driver_installs_the_cpu_build(tmp_path):
    rc, out, err = which(tmp_path, NO_DRIVER)
    assert rc == 0 and err == ""  # nvidia-smi's own message is not passed on
    assert out.startswith("vLLM build: cpu (nvidia-smi -L fails, and no NVIDIA driver lists one in ")
    assert out.endswith("; ./install.sh cuda forces the CUDA build\n") and out.count("\n") == 1


def test_no_nvidia_smi_installs_the_cpu_build(tmp_path):
    rc, out, _ = which(tmp_path, None)
    assert rc == 0
    assert out.startswith("vLLM build: cpu (no nvidia-smi on PATH, and no NVIDIA driver lists one in ")


@pytest.mark.parametrize("nvidia_smi", [None, NO_DRIVER])
def test_gpus_the_driver_lists_install_the_cuda_build_without_a_working_nvidia_smi(tmp_path, nvidia_smi):
    rc, out, _ = which(tmp_path, nvidia_smi, driver_gpus=2)
    assert rc == 0
    assert out.startswith("vLLM build: cuda (")
    assert "but the NVIDIA driver lists 2 GPU(s) in " in out


def test_an_unknown_argument_is_refused_with_the_usage(tmp_path):
    done = subprocess.run(["bash", str(REPO / "install.sh"), "gpu"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "usage: ./install.sh [cpu|cuda|--which]: no argument picks the build for this machine\n"


def test_ci_forces_the_cpu_build():
    """CI runs the CPU build on whatever machine it gets: .ci/run names it rather than letting install.sh choose."""
    assert "\n./install.sh cpu\n" in (REPO / ".ci" / "run").read_text()
