"""Where the engine core and the front end run on vLLM's CPU build: the CPUs the workers leave free (cpu_layout.py),
by hand on the pure parts, and on real processes for the binding and the server's launch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from optimizer.engines import cpu_layout
from optimizer.engines.server import ServerProcess

TWO_CPUS = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to separate")


def test_front_end_cpus_are_those_no_worker_is_bound_to():
    assert cpu_layout.front_end_cpus([0, 1], [[0]]) == {1}
    assert cpu_layout.front_end_cpus(range(8), [[0, 1, 2], [4, 5, 6]]) == {3, 7}
    # a worker bound outside what this process may use takes nothing from it
    assert cpu_layout.front_end_cpus([2, 3], [[0]]) == {2, 3}


def test_nothing_to_separate_is_none():
    assert cpu_layout.front_end_cpus([0, 1], None) is None  # the binding could not be read
    assert cpu_layout.front_end_cpus([0, 1], []) is None  # vLLM binds nothing (nobind, another platform)
    assert cpu_layout.front_end_cpus([0], [[0]]) is None  # one CPU: the workers take it
    assert cpu_layout.front_end_cpus([0, 1], [[0], [1]]) is None


def test_served_launch_binds_the_workers_where_vllm_would():
    assert cpu_layout.omp_bind_value([[0]]) == "0"
    assert cpu_layout.omp_bind_value([[0, 1], [4, 5]]) == "0,1|4,5"
    assert cpu_layout.served_launch([0, 1, 2, 3], [[0, 1, 2]]) == ({3}, {"VLLM_CPU_OMP_THREADS_BIND": "0,1,2"})
    assert cpu_layout.served_launch([0], [[0]]) is None


@TWO_CPUS
def test_bind_threads_binds_every_thread_and_new_ones_inherit():
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, sys, threading
        go = threading.Event()
        threading.Thread(target=go.wait, daemon=True).start()
        sys.stdout.write("ready\\n"); sys.stdout.flush()
        sys.stdin.readline()  # bound by now: a thread started after it inherits the binding
        threading.Thread(target=go.wait, daemon=True).start()
        sys.stdout.write(repr(sorted(os.sched_getaffinity(0))) + "\\n"); sys.stdout.flush()
        sys.stdin.readline()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        target = {sorted(os.sched_getaffinity(0))[-1]}
        assert cpu_layout.bind_threads(child.pid, target) == 2  # the main thread and the first one
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline() == f"{sorted(target)}\n"
        threads = cpu_layout.thread_cpus(child.pid)
        assert len(threads) == 3 and set(threads.values()) == {frozenset(target)}
    finally:
        child.kill()
        child.wait()
    assert cpu_layout.bind_threads(child.pid, {0}) == 0 and cpu_layout.thread_cpus(child.pid) == {}


@TWO_CPUS
def test_keep_off_workers_binds_them_and_this_process(tmp_path):
    own = frozenset(os.sched_getaffinity(0))
    worker_cpu = min(own)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    try:
        cpus = cpu_layout.keep_off_workers([child.pid], [[worker_cpu]], own)
        assert cpus == own - {worker_cpu}
        assert set(cpu_layout.thread_cpus(child.pid).values()) == {cpus}
        assert set(cpu_layout.thread_cpus(os.getpid()).values()) == {cpus}
    finally:
        cpu_layout.bind_threads(os.getpid(), own)
        child.kill()
        child.wait()
    assert frozenset(os.sched_getaffinity(0)) == own
    assert cpu_layout.keep_off_workers([os.getpid()], None, own) is None
    assert frozenset(os.sched_getaffinity(0)) == own  # nothing to separate: nothing bound


@TWO_CPUS
def test_a_server_starts_on_its_cpus_and_logs_the_command_that_does_so(tmp_path):
    cpus = frozenset({sorted(os.sched_getaffinity(0))[-1]})
    probe = "import os; print('cpus', sorted(os.sched_getaffinity(0)), os.environ['VLLM_CPU_OMP_THREADS_BIND'])"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"}
    server = ServerProcess([sys.executable, "-c", probe], tmp_path / "s.log", env, cpus)
    server.start()
    server.proc.wait(timeout=30)
    first, second = (tmp_path / "s.log").read_text().splitlines()[:2]
    bind = "" if os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == "0" else "VLLM_CPU_OMP_THREADS_BIND=0 "
    assert first == f"$ {bind}taskset -c {min(cpus)} {sys.executable} -c {probe}"
    assert second == f"cpus {sorted(cpus)} 0"
    plain = ServerProcess([sys.executable, "-c", "pass"], None, dict(os.environ))
    assert plain.command() == f"{sys.executable} -c pass"  # nothing to separate: the command as given


def test_the_engine_core_alone_is_lowered_every_thread_and_the_log_says_how_to_deploy_it():
    # a child titled as vLLM titles its engine core (setproctitle), with a second thread, and an untitled one
    code = textwrap.dedent("""
        import sys, threading
        if sys.argv[1] == "core":
            import setproctitle
            setproctitle.setproctitle("VLLM::EngineCore")
        threading.Thread(target=sys.stdin.readline, daemon=True).start()
        sys.stdout.write("ready\\n"); sys.stdout.flush()
        sys.stdin.readline()
        """)
    core, other = (subprocess.Popen([sys.executable, "-c", code, kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    text=True) for kind in ("core", "api"))
    try:
        assert core.stdout.readline() == other.stdout.readline() == "ready\n"
        assert cpu_layout.lower_engine_core([other.pid, core.pid, 999_999_999]) == [core.pid]
        nice = {tid: os.getpriority(os.PRIO_PROCESS, tid) for tid in cpu_layout.thread_cpus(core.pid)}
        assert len(nice) == 2 and set(nice.values()) == {cpu_layout.SERVED_CORE_NICENESS}
        assert {os.getpriority(os.PRIO_PROCESS, tid) for tid in cpu_layout.thread_cpus(other.pid)} == {0}
    finally:
        for p in (core, other):
            p.kill()
            p.wait()
    note = cpu_layout.lowered_note(core.pid)
    assert f"pid {core.pid}" in note and note.endswith("renice -n 10 -p $(pgrep -f VLLM::EngineCore)")
