"""Engine processes: what their environment gets by default (optimizer/core/processes.py)."""

from optimizer.core.processes import WORKER_EXIT_WAIT_ENV, worker_exit_defaults
from optimizer.engines.server import ServerProcess


def test_the_worker_exit_wait_is_short_unless_the_user_set_it():
    assert worker_exit_defaults({}) == {"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "1"}
    assert worker_exit_defaults({"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "7"}) == {}  # the user's own value is kept


def test_a_server_child_gets_the_short_worker_exit_wait():
    server = ServerProcess(["true"], None, env={"PATH": "/usr/bin"})
    assert server.env == {"PATH": "/usr/bin", **WORKER_EXIT_WAIT_ENV}
    kept = ServerProcess(["true"], None, env={"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "9"})
    assert kept.env["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] == "9"


def test_the_shared_memory_a_killed_process_left_behind_is_released(tmp_path):
    import subprocess
    import sys
    import time

    import psutil

    from optimizer.core.processes import SHM_DIR, ProcessRef, kill_now, release_shared_memory, shared_memory_of

    # a child maps a segment and keeps it, untracked (as a killed vLLM engine core leaves its message queues)
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from multiprocessing import resource_tracker, shared_memory\n"
        "s = shared_memory.SharedMemory(create=True, size=1 << 20)\n"
        "resource_tracker.unregister(s._name, 'shared_memory')\n"
        "print(s.name, flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    name = child.stdout.readline().strip()
    ref = ProcessRef.of(psutil.Process(child.pid))
    try:
        assert name.startswith("psm_") and (SHM_DIR / name).exists()
        assert name in shared_memory_of([ref])
        segments = shared_memory_of([ref])
        kill_now([ref])
        child.wait(timeout=5)
        time.sleep(0.1)
        assert (SHM_DIR / name).exists()  # killed: nothing of its own released it
        assert release_shared_memory(segments) == [name]
        assert not (SHM_DIR / name).exists()
        assert release_shared_memory(segments) == []  # twice is safe
    finally:
        child.kill()


def test_each_engine_gets_a_socket_directory_that_goes_with_what_was_left_in_it(tmp_path):
    import socket

    from optimizer.core.processes import RPC_DIR_PREFIX, RPC_PATH_ENV, remove_rpc_dir, rpc_dir

    assert rpc_dir({RPC_PATH_ENV: str(tmp_path)}) is None  # the user's own path is kept
    first, second = rpc_dir({}), rpc_dir({RPC_PATH_ENV: ""})
    assert first is not None and second is not None and first != second
    assert first.is_dir() and first.name.startswith(RPC_DIR_PREFIX)
    bound = socket.socket(socket.AF_UNIX)  # what an engine process killed before it closed its socket leaves
    bound.bind(str(first / "a-zmq-socket"))
    assert (first / "a-zmq-socket").is_socket()
    remove_rpc_dir(first)
    remove_rpc_dir(first)  # twice is safe
    remove_rpc_dir(None)
    bound.close()
    assert not first.exists() and second.exists()
    remove_rpc_dir(second)


def test_the_socket_directory_of_a_process_that_was_killed_goes_with_the_next_one(tmp_path):
    import os
    import subprocess

    from optimizer.core.processes import RPC_DIR_PREFIX, rpc_dir

    ended = subprocess.Popen(["true"])
    ended.wait()  # its PID is free now
    left = tmp_path / f"{RPC_DIR_PREFIX}{ended.pid}-abc"  # a killed study's, sockets and all
    left.mkdir()
    (left / "socket").touch()
    alive = tmp_path / f"{RPC_DIR_PREFIX}{os.getppid()}-def"  # a live process's: another study's engine
    alive.mkdir()
    other = tmp_path / f"{RPC_DIR_PREFIX}notapid"  # not one of ours by its name: left alone
    other.mkdir()
    made = rpc_dir({}, parent=tmp_path)
    assert made is not None and made.name.startswith(f"{RPC_DIR_PREFIX}{os.getpid()}-") and made.parent == tmp_path
    assert not left.exists() and alive.exists() and other.exists()
    assert rpc_dir({}, parent=tmp_path) is not None and made.exists()  # this process is alive: its own dir stays
