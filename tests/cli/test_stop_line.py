"""Every command, not only a study's run, ends on Ctrl-C or SIGTERM with one line that says what to do next and the
signal's exit code (core/signals.py through cli/common.py::guarded): `timeout 10m optimize verify ...` shuts down
the engines it started on SIGTERM."""

import subprocess
import sys
import textwrap

import pytest

from optimizer.core.signals import EXIT_SIGINT, EXIT_SIGTERM

# the command's work: the signal arrives while it runs, and its `finally` (where an engine is shut down) still runs
BODY = textwrap.dedent("""
    import os, signal, sys, time
    from optimizer.cli.common import guarded

    def work():
        try:
            os.kill(os.getpid(), signal.{sig})
            time.sleep(30)
        finally:
            print("shut down", flush=True)
        return 0

    sys.exit(guarded(False, work, {command!r}))
""")


@pytest.mark.parametrize("sig, code, how", [("SIGTERM", EXIT_SIGTERM, "SIGTERM"), ("SIGINT", EXIT_SIGINT, "Ctrl-C")])
@pytest.mark.parametrize("command, said", [
    ("verify", "`optimize verify` stopped before it finished; run it again"),
    (None, "the running trial was stopped; run the same command again to resume"),
])
def test_a_stopped_command_prints_one_line_and_the_signals_code(sig, code, how, command, said):
    done = subprocess.run([sys.executable, "-c", BODY.format(sig=sig, command=command)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == code, done.stderr
    assert done.stdout == "shut down\n"
    assert done.stderr.strip() == f"interrupted ({how}): {said}"
