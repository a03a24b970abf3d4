"""Which allocator the CPU engine's processes run on (optimizer/engines/allocator.py): a tcmalloc first in
LD_PRELOAD, where vLLM's CPU platform puts the one its wheels bundle, and an allocator already named left alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from optimizer.engines.allocator import find_tcmalloc, preload_tcmalloc, with_allocator
from optimizer.engines.server import ServerProcess

GOMP = "/venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1"
TC = "libtcmalloc_minimal.so.4"


@pytest.mark.parametrize("before, library, after", [
    ("", TC, TC),  # nothing preloaded: the allocator alone
    (GOMP, TC, f"{TC}:{GOMP}"),  # first, before torch's libgomp (vLLM puts its bundled tcmalloc first too)
    (f"/opt/libtcmalloc.so.4:{GOMP}", TC, None),  # a tcmalloc already there (vLLM's, or the user's)
    ("/usr/lib/libjemalloc.so.2", TC, None),  # the user chose another allocator
    (GOMP, None, None),  # none found: nothing changes
])
def test_the_allocator_goes_first_unless_one_is_already_preloaded(before, library, after):
    assert with_allocator(before, library) == after


def test_preloading_sets_the_environment_and_says_which_allocator():
    env = {"LD_PRELOAD": GOMP}
    line = preload_tcmalloc(env, TC)
    assert env["LD_PRELOAD"] == f"{TC}:{GOMP}" and TC in line
    assert preload_tcmalloc(env, TC).endswith("with the tcmalloc LD_PRELOAD names")  # once only
    assert env["LD_PRELOAD"] == f"{TC}:{GOMP}"


def test_without_a_tcmalloc_the_log_line_says_how_to_install_one(monkeypatch):
    monkeypatch.setattr("optimizer.engines.allocator.find_tcmalloc", lambda: None)
    env: dict[str, str] = {}
    line = preload_tcmalloc(env)
    assert env == {} and "glibc's malloc" in line and "apt-get install libtcmalloc-minimal4" in line


@pytest.mark.skipif(find_tcmalloc() is None, reason="no tcmalloc on this machine (install.sh cpu installs one)")
def test_a_process_started_with_it_maps_the_found_tcmalloc_and_its_command_shows_it(tmp_path):
    env = {"PATH": "/usr/bin:/bin"}
    preload_tcmalloc(env)
    probe = "print(open('/proc/self/maps').read())"
    maps = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert "libtcmalloc" in maps
    server = ServerProcess([sys.executable, "-c", "pass"], tmp_path / "s.log", env)
    assert server.command().startswith(f"LD_PRELOAD={env['LD_PRELOAD']} ")  # a rerun by hand runs on it too
