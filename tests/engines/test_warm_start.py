"""Warm starts (optimizer/engines/warm_start.py): when a fork reproduces vLLM's spawn, and the worker's OpenMP binding.
The engine itself, forked and spawned side by side: tests/engines/test_warm_start_engine.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from optimizer.engines.warm_start import gomp_cpus, load_time_env, refusal

GOMP = "/venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1"
ENV = {"LD_PRELOAD": GOMP, "PATH": "/usr/bin", "HOME": "/root"}


@pytest.mark.parametrize("value,cpus", [("0", [0]), ("3", [3]), ("0 3 1-2 4-8:2", [0, 3, 1, 2, 4, 6, 8]),
                                        ("0,1", [0, 1]), ("", [])])
def test_gomp_cpus_reads_libgomps_list_forms(value, cpus):
    assert gomp_cpus(value) == cpus


def test_load_time_env_keeps_what_libraries_read_at_load():
    env = {"LD_PRELOAD": "a", "OMP_NUM_THREADS": "1", "KMP_AFFINITY": "x", "PYTHONPATH": "p", "VLLM_X": "1",
           "PATH": "/bin"}
    assert load_time_env(env) == {"LD_PRELOAD": "a", "OMP_NUM_THREADS": "1", "KMP_AFFINITY": "x", "PYTHONPATH": "p"}


def test_the_cpu_builds_default_start_may_be_warm():
    # one worker bound to one CPU (2 cores, one reserved for the engine core), the trial setting a vLLM variable
    assert refusal({"VLLM_CPU_KVCACHE_SPACE": "1"}, ENV, None, [[0]]) is None
    assert refusal({}, ENV, dict(ENV, PATH="/other", VLLM_LOGGING_LEVEL="DEBUG"), [[0]]) is None  # not load-time
    assert refusal({}, ENV, ENV, []) is None  # VLLM_CPU_OMP_THREADS_BIND=nobind: vLLM binds nothing


def test_a_trial_variable_outside_vllms_starts_cold_and_is_named():
    reason = refusal({"OMP_NUM_THREADS": "2", "VLLM_X": "1"}, ENV, None, [[0]])
    assert reason is not None and "OMP_NUM_THREADS" in reason and "VLLM_X" not in reason


def test_without_torchs_libgomp_preloaded_the_start_is_cold():
    reason = refusal({}, {"PATH": "/usr/bin"}, None, [[0]])
    assert reason is not None and "libgomp" in reason


def test_a_fork_server_loaded_with_another_environment_is_not_used():
    reason = refusal({}, ENV, dict(ENV, LD_PRELOAD=f"/x/libtcmalloc.so:{GOMP}"), [[0]])
    assert reason is not None and "LD_PRELOAD" in reason
    reason = refusal({}, ENV, dict(ENV, OMP_PROC_BIND="true"), [[0]])
    assert reason is not None and "OMP_PROC_BIND" in reason


def test_a_worker_with_several_openmp_threads_or_an_unknown_binding_starts_cold():
    reason = refusal({}, ENV, None, [[0, 1, 2]])
    assert reason is not None and "3 OpenMP threads" in reason
    assert refusal({}, ENV, None, [[0], [1, 2]]) is not None  # two workers, the second with two threads
    assert refusal({}, ENV, None, None) is not None


def test_a_forked_process_is_bound_as_libgomp_binds_a_spawned_one():
    """The hook the engine core registers, in a real fork: the child takes the first CPU of GOMP_CPU_AFFINITY (as
    libgomp binds its one thread at load) and OMP_NUM_THREADS threads; the parent keeps its own."""
    cpus = sorted(os.sched_getaffinity(0))
    target = cpus[-1]
    code = textwrap.dedent(f"""
        import json, os, sys
        import torch
        from optimizer.engines.warm_start import bind_openmp_as_at_load
        torch.set_num_threads({len(cpus)})
        os.register_at_fork(after_in_child=bind_openmp_as_at_load)
        os.environ["GOMP_CPU_AFFINITY"] = "{target}"
        os.environ["OMP_NUM_THREADS"] = "1"
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(w, json.dumps([sorted(os.sched_getaffinity(0)), torch.get_num_threads()]).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        child = json.loads(os.read(r, 1000))
        print(json.dumps({{"child": child, "parent": [sorted(os.sched_getaffinity(0)), torch.get_num_threads()]}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["child"] == [[target], 1]
    assert got["parent"] == [cpus, len(cpus)]


def test_cold_starts_flag_reaches_the_studys_engines(tmp_path):
    """`--cold-starts` is stored with the study and every in-process engine it makes starts as vLLM does."""
    from optimizer.cli.run import build_parser, explicit_settings
    from optimizer.config.settings import StudyConfig
    from optimizer.search.runner import factory_for

    settings = explicit_settings(build_parser().parse_args(["--ttft-p99", "150ms", "--cold-starts"]))
    assert settings["warm_starts"] is False
    assert "warm_starts" not in explicit_settings(build_parser().parse_args(["--ttft-p99", "150ms"]))
    base = {"study_name": "s", "storage_url": f"sqlite:///{tmp_path}/s.db", "ttft_p99_ms": 150.0, "budget": 2,
            "model": "m"}
    assert factory_for(StudyConfig(**base, warm_starts=False), "m")().warm_starts is False
    assert factory_for(StudyConfig(**base), "m")().warm_starts is True


def test_the_installed_vllm_launches_through_the_context_a_warm_start_replaces():
    """vLLM 0.32's launcher takes its engine-core processes from `get_mp_context`; `launch_from` swaps it for the
    block only."""
    import vllm.v1.engine.utils as launcher

    from optimizer.engines.warm_start import launch_from, launcher_takes_a_context

    assert launcher_takes_a_context()
    own, marker = launcher.get_mp_context, object()
    with launch_from(marker):
        assert launcher.get_mp_context() is marker
    assert launcher.get_mp_context is own
