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
