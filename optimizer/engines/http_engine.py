"""The HTTP backend: vLLM's OpenAI-compatible server, measured from the client side as users' clients see it.

`HttpEngine` starts a server per trial with the trial's parameters (server.py) and streams `/v1/completions`
with token-id prompts; `RemoteEngine` measures an already-running server (a deployment) and never restarts or
ends it. Both count new tokens per chunk from `token_ids` (`return_token_ids`), so the count does not depend on
detokenization, and fall back to the final usage chunk for a server that does not return them.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from optimizer.config.resolved import Resolved
from optimizer.core import failures
from optimizer.core.errors import EngineDiedError, EngineStartError, UsageError
from optimizer.core.processes import ProcessRef, remove_rpc_dir, renew_rpc_dir
from optimizer.engines import allocator, cpu_layout, warm_start
from optimizer.engines.server import (
    ServerProcess, classify_server_failure, flag_name, free_port, server_argv, vllm_flag_kinds,
)
from optimizer.measurement.workload import Request
from optimizer.params.open_space import split_env

_HEALTH_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
_KV_TOKENS = re.compile(r"[CG]PU KV cache size: ([\d,]+) tokens")
_KEEPALIVE_S = 4.0
_RESET_WAIT_S = 10.0  # how long a prefix-cache reset is retried while running requests still hold blocks
_RESET_RETRY_S = 0.25


class _HttpClient:
    """Streaming completions client over one aiohttp session; the server side is the subclass's business."""

    # The managed server always has /reset_prefix_cache (dev mode); a deployment (measure-only) may not.
    measure_only = False

    def __init__(self) -> None:
        self.base_url = ""
        self.model_name = ""
        self.model_root = ""
        self.max_model_len: int | None = None
        self.reset_supported = True
        self._session: aiohttp.ClientSession | None = None

    def _open(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        # limit=0: no cap on open connections, or a burst above aiohttp's default 100 would queue in the client.
        # Idle connections are dropped before uvicorn's 5 s keep-alive closes them under us.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEPALIVE_S)
        self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))

    async def _close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def healthy(self) -> bool:
        """True when GET /health answers 200."""
        if self._session is None:
            return False
        try:
            async with self._session.get(f"{self.base_url}/health", timeout=_HEALTH_TIMEOUT) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _read_models(self) -> None:
        assert self._session is not None
        async with self._session.get(f"{self.base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            resp.raise_for_status()
            data = (await resp.json()).get("data") or []
        if not data:
            raise RuntimeError(f"{self.base_url}/v1/models lists no model")
        self.model_name = data[0]["id"]
        self.model_root = data[0].get("root") or self.model_name
        self.max_model_len = data[0].get("max_model_len")

    async def _server_gone(self) -> bool:
        return not await self.healthy()

    async def generate(self, request: Request) -> AsyncIterator[int]:
        """Stream one completion; yield the number of new tokens of each chunk as it arrives."""
        if self._session is None:
            raise RuntimeError("the engine is not started")
        payload = {
            "model": self.model_name,
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.output_len,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        }
        counted = 0
        for attempt in (1, 2):
            try:
                async for n in self._stream(payload):
                    counted += n
                    yield n
                return
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                # A kept-alive connection the server closed as we reused it: nothing was served, send it again.
                if counted or attempt == 2 or await self._server_gone():
                    raise

    async def _stream(self, payload: dict[str, Any]) -> AsyncIterator[int]:
        assert self._session is not None
        counted = 0
        try:
            async with self._session.post(f"{self.base_url}/v1/completions", json=payload) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
                async for msg in _sse_messages(resp):
                    if "error" in msg:
                        raise RuntimeError(f"server error: {str(msg['error'])[:300]}")
                    choices = msg.get("choices")
                    if choices:
                        ids = choices[0].get("token_ids")
                        n = len(ids) if ids is not None else (1 if choices[0].get("text") else 0)
                        if n:
                            counted += n
                            yield n
                    elif usage := msg.get("usage"):
                        # A server without token ids: its usage total corrects the per-chunk count.
                        extra = int(usage.get("completion_tokens") or 0) - counted
                        if extra > 0:
                            counted += extra
                            yield extra
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:  # refused, reset, cut short
            if await self._server_gone():
                raise EngineDiedError(f"the server at {self.base_url} stopped answering: {exc}") from None
            raise

    async def reset_prefix_cache(self) -> None:
        """POST /reset_prefix_cache, retried while running requests still hold blocks."""
        if self._session is None or not self.reset_supported:
            return
        deadline = time.monotonic() + _RESET_WAIT_S
        while True:
            try:
                async with self._session.post(f"{self.base_url}/reset_prefix_cache") as resp:
                    if resp.status == 404 and self.measure_only:
                        self.reset_supported = False  # a deployment without VLLM_SERVER_DEV_MODE=1: replays run warm
                        return
                    if resp.status != 200:
                        raise RuntimeError(f"POST /reset_prefix_cache: HTTP {resp.status}: "
                                           f"{(await resp.text())[:200]}")
                    body = await resp.json(content_type=None)
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                body = {"success": False}  # a kept-alive connection closed under us: try again
            if not isinstance(body, dict) or body.get("success", True):
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the server refused to reset its prefix cache for {_RESET_WAIT_S:.0f} s (blocks "
                                   f"still held)")
            await asyncio.sleep(_RESET_RETRY_S)


async def _sse_messages(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """Server-sent `data:` messages as dicts, however the bytes are split (a prompt echo can exceed a line limit).

    After `[DONE]` the body is read to its end: aiohttp returns a connection to its pool only when its response was
    read whole, and a new connection for every request (a connect and an accept on the server, on the cores the
    server and the engine use) was measured at 151 of 600 requests against 25 when read to the end."""
    buf = b""
    async for part in resp.content.iter_any():
        buf += part
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                async for _ in resp.content.iter_any():  # the rest of the body, so that the connection is pooled
                    pass
                return
            yield json.loads(data)


class HttpEngine(_HttpClient):
    """A fresh `vllm serve` per trial with the trial's parameters, bound to 127.0.0.1 on a free port.

    `base_args` (model, dtype, ...) are fixed; `start(params)` adds the trial's values. The server's output goes
    to the trial's log; a failed start is classified from it like the in-process engine's.
    """

    def __init__(self, base_args: dict[str, Any], host: str = "127.0.0.1", start_timeout_s: float = 900.0,
                 shutdown_timeout_s: float = 20.0, python: str = sys.executable) -> None:
        super().__init__()
        self._base_args = {"disable_log_stats": True, **base_args}
        self._host = host
        self._start_timeout_s = start_timeout_s
        self._shutdown_timeout_s = shutdown_timeout_s
        self._python = python
        self._server: ServerProcess | None = None
        self._refs: list[ProcessRef] = []
        self._own_cpus: frozenset[int] | None = None  # this process's CPUs before `start` bound it (cpu_layout.py)
        self._rpc_dir: Path | None = None  # the server's ZMQ socket files (core/processes.py::rpc_dir)

    @property
    def pids(self) -> list[int]:
        return [r.pid for r in self.process_refs]

    @property
    def process_refs(self) -> list[ProcessRef]:
        return self._server.refresh() if self._server is not None else list(self._refs)

    @property
    def sockets_dir(self) -> Path | None:
        """Where the running server's ZMQ sockets are (None: not started, or the user's VLLM_RPC_BASE_PATH)."""
        return self._rpc_dir

    def validate(self, params: dict[str, Any]) -> Resolved:
        """vLLM's own config validation, as the in-process engine does it (no server started), and what it
        resolved. The server resolves the same: `vllm serve` builds the same config from the same arguments."""
        from optimizer.engines.vllm_engine import VllmEngine

        return VllmEngine(self._base_args).validate(params)

    async def start(self, params: dict[str, Any], log_path: Path | None = None) -> dict[str, Any]:
        kinds = await asyncio.to_thread(vllm_flag_kinds)
        params, trial_env = split_env(params)  # `env:NAME` parameters go into the server's environment
        unknown = sorted(k for k in {**self._base_args, **params} if flag_name(k) not in kinds)
        if unknown:
            raise EngineStartError(f"vLLM's server has no flag for {', '.join(unknown)} (not an engine argument)",
                                   failures.INVALID_CONFIG)
        args = {**self._base_args, **params}
        env = {**os.environ, **trial_env, "VLLM_SERVER_DEV_MODE": "1"}  # for /reset_prefix_cache
        config = await asyncio.to_thread(self._engine_config, params)  # once: for the layout and what ran
        # on the CPU build, the server's processes allocate with tcmalloc where the machine has one (allocator.py)
        said = allocator.preload_tcmalloc(env) if config is not None and config.device_config.device_type == "cpu" \
            else None
        # a trial that binds the workers itself is started as it says
        layout = None if "VLLM_CPU_OMP_THREADS_BIND" in trial_env or config is None else \
            cpu_layout.served_launch(os.sched_getaffinity(0), warm_start.worker_cpus(config))
        cpus = None
        if layout is not None:  # the server on the CPUs its workers leave free, the workers bound (cpu_layout.py)
            cpus, bind_env = layout
            env = {**bind_env, **env}  # a binding of the user's own is kept
        for attempt in range(3):
            port = free_port(self._host)
            self._rpc_dir, sockets = renew_rpc_dir(self._rpc_dir, env)
            server = ServerProcess(server_argv(args, self._host, port, kinds, self._python), log_path,
                                   {**env, **sockets}, cpus)
            self._server = server
            self._open(f"http://{self._host}:{port}")
            try:
                server.start()
                if said:
                    server.note(said)
                ready = await self._wait_ready(server)
            except BaseException:  # a timeout or Ctrl-C mid-start: end what started, then let it propagate
                await self.shutdown()
                raise
            if ready:
                break
            await self.shutdown()
            text = server.log_text()
            if "address already in use" in text.lower() and attempt < 2:
                continue  # another process took the port between our probe and the server's bind
            reason, detail = classify_server_failure(server.exit_code(), text)
            raise EngineStartError(detail, reason, log_excerpt=text[-4000:])
        await self._read_models()
        if cpus is not None:  # the client keeps off the workers' CPUs too, and the engine core yields to both
            self._own_cpus = frozenset(os.sched_getaffinity(0))
            cpu_layout.bind_threads(os.getpid(), cpus)
            for pid in cpu_layout.lower_engine_core(self.pids):
                server.note(cpu_layout.lowered_note(pid))
        return self._resolved(params, config)

    def _engine_config(self, params: dict[str, Any]) -> Any:
        """vLLM's config built as its API server builds it: where the CPU build binds its workers
        (cpu_layout.served_launch) and what the server runs with (`_resolved`); None where vLLM rejects it (the
        server reports an invalid config itself)."""
        from vllm.usage.usage_lib import UsageContext

        from optimizer.engines.vllm_engine import VllmEngine

        try:
            return VllmEngine(self._base_args).engine_args(params).create_engine_config(UsageContext.OPENAI_API_SERVER)
        except Exception:
            return None

    async def _wait_ready(self, server: ServerProcess) -> bool:
        deadline = time.monotonic() + self._start_timeout_s
        while server.exit_code() is None:
            server.refresh()
            if await self.healthy():
                server.refresh()
                return True
            if time.monotonic() > deadline:
                raise EngineStartError(f"the server did not answer /health within {self._start_timeout_s:.0f} s",
                                       failures.TIMEOUT)
            await asyncio.sleep(0.5)
        return False

    def _resolved(self, params: dict[str, Any], config: Any) -> dict[str, Any]:
        """What the server runs with: `config` (`_engine_config`), KV blocks from its log."""
        from optimizer.engines.vllm_engine import resolved_config

        try:
            resolved = resolved_config(config) if config is not None else dict(params)
        except Exception:  # the server took it; only our copy of the resolution failed
            resolved = dict(params)
        if self.max_model_len:
            resolved["max_model_len"] = self.max_model_len
        m = _KV_TOKENS.search(self._server.log_text() if self._server else "")
        if m and resolved.get("block_size"):
            resolved["num_kv_blocks"] = int(m.group(1).replace(",", "")) // int(resolved["block_size"])
        resolved["url"] = self.base_url
        return resolved

    async def _server_gone(self) -> bool:
        return self._server is None or self._server.exit_code() is not None

    async def shutdown(self) -> None:
        if self._own_cpus is not None:  # this process gets its CPUs back
            cpu_layout.bind_threads(os.getpid(), self._own_cpus)
            self._own_cpus = None
        await self._close()
        server, self._server = self._server, None
        if server is not None:
            self._refs = server.refresh()
            await asyncio.to_thread(server.stop, self._shutdown_timeout_s)
        remove_rpc_dir(self._rpc_dir)
        self._rpc_dir = None


class RemoteEngine(_HttpClient):
    """Measure-only: an already-running server at `url`. `start` waits for /health; `shutdown` ends nothing."""

    measure_only = True

    def __init__(self, url: str, wait_s: float = 10.0) -> None:
        super().__init__()
        self.url = check_url(url)
        self._wait_s = wait_s

    @property
    def pids(self) -> list[int]:
        return []

    @property
    def process_refs(self) -> list[ProcessRef]:
        return []

    def validate(self, params: dict[str, Any]) -> None:
        if params:
            raise EngineStartError(f"the running server at {self.url} cannot take engine parameters "
                                   f"({', '.join(sorted(params))}): restart it with them, or let each trial start its "
                                   f"own server",
                                   failures.INVALID_CONFIG)

    async def start(self, params: dict[str, Any] | None = None, log_path: Path | None = None) -> dict[str, Any]:
        self.validate(params or {})
        self._open(self.url)
        deadline = time.monotonic() + self._wait_s
        while not await self.healthy():
            if time.monotonic() >= deadline:
                await self._close()
                raise UsageError(f"no vLLM server answers at {self.url}/health (waited {self._wait_s:.0f} s): start "
                                 f"one (python -m vllm.entrypoints.openai.api_server --model ...) or give the URL it "
                                 f"listens on")
            await asyncio.sleep(0.5)
        try:
            await self._read_models()
        except (aiohttp.ClientError, RuntimeError, KeyError, ValueError) as exc:
            await self._close()
            raise UsageError(f"{self.url} answers /health but not /v1/models ({exc}): is it vLLM's OpenAI-compatible "
                             f"server?") from None
        return {"url": self.url, "model": self.model_name, "max_model_len": self.max_model_len}

    async def shutdown(self) -> None:
        await self._close()


def check_url(url: str) -> str:
    """An http(s)://host:port URL without a trailing slash, or a UsageError that shows the expected form."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"{url!r} is not a server URL: give http://HOST:PORT, e.g. http://127.0.0.1:8000")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise UsageError(f"{url!r} has a bad port: give http://HOST:PORT, e.g. http://127.0.0.1:8000") from None
    return url.rstrip("/")
