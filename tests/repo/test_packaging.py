"""The distribution as pip builds it: its name on PyPI, the Apache-2.0 license, the `optimize` command, and the GPU
demo's config.json inside the wheel (built from a copy of the sources, offline, with the setuptools installed)."""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

from tests.conftest import REPO

NAME = "vllm-config-optimizer"  # free on PyPI; vllm-optimizer is another project's


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("setuptools", minversion="77")  # the license expression needs it
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "optimizer", src / "optimizer", ignore=shutil.ignore_patterns("__pycache__"))
    out = src / "dist"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src),
                           "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [built] = out.glob("*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_is_named_licensed_and_described(wheel):
    [meta_path] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    meta = email.message_from_bytes(wheel.read(meta_path))
    assert meta["Name"] == NAME and meta["License-Expression"] == "Apache-2.0"
    assert meta["License-File"] == "LICENSE"
    assert any(url.startswith("Repository, https://") for url in meta.get_all("Project-URL"))
    assert "Environment :: GPU :: NVIDIA CUDA" in meta.get_all("Classifier") and "vllm" in meta["Keywords"]
    [license_text] = [wheel.read(n).decode() for n in wheel.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
    assert license_text == (REPO / "LICENSE").read_text()
    [entry_points] = [wheel.read(n).decode() for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    assert "optimize = optimizer.cli.main:main" in entry_points


def test_the_gpu_demo_config_ships_in_the_wheel(wheel):
    shipped = "optimizer/config/embedded/llama3.2-1b-dummy/config.json"
    assert wheel.read(shipped) == (REPO / shipped).read_bytes()


def test_the_license_is_apache_2_with_the_projects_copyright():
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text and "   Copyright 2026 The optimizer authors\n" in text
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["name"] == NAME and project["license"] == "Apache-2.0"
    assert project["scripts"] == {"optimize": "optimizer.cli.main:main"}
