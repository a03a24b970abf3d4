"""vLLM's OpenAI-compatible server as a child process: engine params -> CLI flags, start, health, stop.

The server runs as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script of the CPU build fails
on a package-metadata look-up; the module works) in a new session, so that stopping it ends its whole process
group: the API server, its engine core and any worker.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import psutil

from optimizer.core import failures
from optimizer.core.processes import (
    ProcessRef, end_processes, release_shared_memory, shared_memory_of, worker_exit_defaults,
)

SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# How vLLM's parser takes a boolean: `--x/--no-x` (BooleanOptionalAction) or a bare `--x` (store_true).
BOOL_BOTH = "bool"
BOOL_TRUE_ONLY = "store_true"
VALUE = "value"


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def to_flags(params: Mapping[str, Any], kinds: Mapping[str, str]) -> list[str]:
    """Engine keyword arguments (AsyncEngineArgs names) -> `vllm serve` flags.

    `kinds` maps a flag to how vLLM's parser reads it (see `vllm_flag_kinds`). Booleans become `--enable-x` or
    `--no-enable-x`; a store_true flag that is False is left out (False is its default); None means "vLLM's
    default" and is left out; dicts are JSON; lists give one value each after the flag.
    """
    out: list[str] = []
    for name, value in params.items():
        flag = flag_name(name)
        kind = kinds.get(flag, VALUE)
        if value is None:
            continue
        if isinstance(value, bool):
            if kind == BOOL_BOTH:
                out.append(flag if value else "--no-" + flag[2:])
            elif kind == BOOL_TRUE_ONLY:
                if value:
                    out.append(flag)
            else:
                out += [flag, str(value).lower()]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        elif isinstance(value, (list, tuple)):
            out += [flag, *(str(v) for v in value)]
        else:
            out += [flag, str(value)]
    return out


@lru_cache(maxsize=1)
def vllm_flag_kinds() -> dict[str, str]:
    """Every flag of vLLM's server parser and how it takes a value (imports vLLM: a few seconds, once)."""
    import argparse

    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    kinds: dict[str, str] = {}
    for flag, action in make_arg_parser(FlexibleArgumentParser())._option_string_actions.items():
        if isinstance(action, argparse.BooleanOptionalAction):
            kinds[flag] = BOOL_BOTH
        elif isinstance(action, argparse._StoreTrueAction):
            kinds[flag] = BOOL_TRUE_ONLY
        else:
            kinds[flag] = VALUE
    return kinds


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the server binds it a moment later; a lost race is retried by the caller)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One server child in its own session; `stop()` ends its process group and every recorded descendant."""

    def __init__(self, argv: list[str], log_path: Path | None, env: Mapping[str, str] | None = None,
                 cpus: frozenset[int] | None = None) -> None:
        self.argv = argv
        self.cpus = cpus  # the CPUs it starts on (its children inherit them); None: any
        self.log_path = log_path
        given = dict(os.environ if env is None else env)
        self.env = {**given, **worker_exit_defaults(given)}
        self.proc: subprocess.Popen[bytes] | None = None
        self._refs: dict[int, ProcessRef] = {}

    def start(self) -> None:
        out: Any = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path, "ab")
            out.write(f"$ {self.command()}\n".encode())  # the exact command, for reruns by hand
            out.flush()
        try:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)
            if self.cpus is not None:  # before the server's imports end, so before it starts any child
                try:
                    os.sched_setaffinity(self.proc.pid, self.cpus)
                except OSError:  # it has exited already: its log says why
                    pass
        finally:
            if self.log_path is not None:
                out.close()  # the child holds its own copy of the descriptor
        self.refresh()

    def note(self, line: str) -> None:
        """One line of ours in the server's log, beside its own output."""
        if self.log_path is not None:
            with open(self.log_path, "a") as out:
                out.write(line + "\n")

    def command(self) -> str:
        """The command line as a shell would run it: the workers' binding and the CPUs it starts on included."""
        bind = self.env.get("VLLM_CPU_OMP_THREADS_BIND")
        ours = bind and bind != os.environ.get("VLLM_CPU_OMP_THREADS_BIND")  # set by us, not already in the shell
        prefix = f"VLLM_CPU_OMP_THREADS_BIND={bind} " if ours else ""
        preload = self.env.get("LD_PRELOAD", "")
        if "tcmalloc" in preload and preload != os.environ.get("LD_PRELOAD"):  # allocator.py's, not the shell's
            prefix = f"LD_PRELOAD={preload} " + prefix
        if self.cpus is not None:
            prefix += f"taskset -c {','.join(str(c) for c in sorted(self.cpus))} "
        return prefix + " ".join(self.argv)

    def refresh(self) -> list[ProcessRef]:
        """Record the server and its descendants as they appear (a kill mid-start leaves them on record)."""
        if self.proc is None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                try:
                    self._refs.setdefault(p.pid, ProcessRef.of(p))
                except psutil.NoSuchProcess:
                    pass
        except psutil.NoSuchProcess:
            pass
        return self.refs

    @property
    def refs(self) -> list[ProcessRef]:
        return sorted(self._refs.values(), key=lambda r: r.pid)

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it after `grace_s`, then end any recorded process that left the group.

        Safe to call twice and after the server exited by itself.
        """
        if self.proc is None:
            return
        segments = shared_memory_of(self.refresh())
        pgid = self.proc.pid  # start_new_session: the server leads its own group
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        _signal_group(pgid, signal.SIGKILL)  # whatever is left of the group, the server included
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        end_processes(self.refs, grace_s=2.0)  # a child that started its own session
        release_shared_memory(segments)  # the engine's message queues, when the kill came before its teardown

    def log_text(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def server_argv(model_args: Mapping[str, Any], host: str, port: int, kinds: Mapping[str, str],
                python: str = sys.executable) -> list[str]:
    """The command line that starts the server with these engine arguments on host:port."""
    return [python, "-m", SERVER_MODULE, *to_flags(model_args, kinds), "--host", host, "--port", str(port)]


ARGPARSE_ERROR = re.compile(r"error: (unrecognized arguments: [^\n]*|argument [^\n]*)")


def classify_server_failure(exit_code: int | None, log_text: str) -> tuple[str, str]:
    """(reason, detail) for a server that exited before it was healthy, from its log."""
    m = ARGPARSE_ERROR.search(log_text)
    if m:
        return failures.INVALID_CONFIG, f"vLLM's server refuses the flags: {m.group(1)}"
    return failures.classify(f"the server exited with code {exit_code}", log_text)
