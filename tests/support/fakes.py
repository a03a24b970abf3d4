"""Fakes and small builders shared by the tests: one definition each, imported where they are used.

`SimEngine`: the simulator (optimizer/engines/simulated.py) for the architecture of the `config_only_model`
fixture; `make_config`: a short study on it; `run_study`: prepare and run it to its budget; `unwrapped`: a
screen's wrapped sentences whole; `run_cli`: the CLI in-process, with its exit code and stderr; `load`: a study of a
SQLite file that `optimize` wrote; `polled_trials`: its trials while `optimize` may still be creating it;
`FakeServer`: vLLM's OpenAI completions stream, as aiohttp.web serves it, for the HTTP client and the measure-only
engine.
"""

from __future__ import annotations

import asyncio
import json

from pathlib import Path

import optuna
from aiohttp import web
from sqlalchemy.exc import SQLAlchemyError

from optimizer.config.model import DEFAULT_MODEL_CONFIG, model_info
from optimizer.config.settings import StudyConfig
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.engines.simulated import SimulatedEngine
from optimizer.search.runner import prepare, run


class SimEngine(SimulatedEngine):
    """The simulator for the architecture of `config_only_model` (its own memory: 24 GiB, 90% usable)."""

    def __init__(self):
        super().__init__(model_info({**DEFAULT_MODEL_CONFIG, "max_position_embeddings": 1024}, "sim"))


def config_only_model_in(folder: Path) -> Path:
    """`folder/arch`: a model directory with a config.json and no weights (the `config_only_model` fixture's), for a
    fixture wider than one test."""
    d = folder / "arch"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**DEFAULT_MODEL_CONFIG, "max_position_embeddings": 1024}))
    return d


def make_config(tmp_path, model, **kw) -> StudyConfig:
    """A 3-trial study of 40 short requests with a 30 ms TTFT P99 limit; `kw` overrides any field."""
    base = dict(study_name="s", storage_url=f"sqlite:///{tmp_path}/s.db", ttft_p99_ms=30.0, budget=3,
                model=str(model), dummy_weights=True, device="cpu",
                workload=WorkloadSpec(num_requests=40, warmup_requests=2, input_len_min=64, input_len_max=256,
                                      output_len_min=2, output_len_max=6))
    if "limits" in kw:  # limits of its own instead of the TTFT P99 one
        base.pop("ttft_p99_ms")
    return StudyConfig(**{**base, **kw})


def run_study(tmp_path, config, engine=SimEngine) -> optuna.Study:
    # the simulated engine has its own memory limit: this machine's memory must not decide these tests
    prepared = prepare(config, tmp_path, say=lambda *a: None, engine_factory=engine, memory_probe=lambda: None)
    return run(prepared, quiet=True)


def unwrapped(text: str) -> list[str]:
    """The lines of a screen with each sentence the console wrapped (its continuation lines indented by two spaces)
    joined again, for a test that reads a sentence whole."""
    lines: list[str] = []
    for line in text.splitlines():
        if lines and line.startswith("  ") and not line.startswith("   "):
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    return lines


def run_cli(capsys, *argv) -> tuple[int, str]:
    """`optimize ARGV` in-process: its exit code and what it wrote to stderr."""
    from optimizer.cli.main import main

    code = main(list(argv))
    return code, capsys.readouterr().err


def load(studies, name: str = "default") -> optuna.Study:
    """Study `name` of `studies/<name>.db`, as `optimize --studies-dir STUDIES` writes it."""
    return optuna.load_study(study_name=name, storage=f"sqlite:///{studies}/{name}.db")


def polled_trials(studies: Path, name: str = "default") -> list[optuna.trial.FrozenTrial]:
    """The trials of `load(studies, name)`, for a test that polls a running `optimize`: none while the file or the
    study does not exist yet, or when this poll raced the study's creation (opening a storage creates its tables,
    and two processes that do it at once collide: Optuna's check-then-insert of the schema version is not atomic)."""
    if not (studies / f"{name}.db").exists():
        return []
    try:
        return load(studies, name).get_trials(deepcopy=False)
    except (KeyError, optuna.exceptions.StorageInternalError, SQLAlchemyError):
        return []


class FakeServer:
    """Streams `n` tokens per request in SSE chunks of `per_chunk`; optionally without token_ids, or dropping."""

    def __init__(self, token_ids=True, per_chunk=2, reset=True, drop_after=None, hang_up_first=False):
        self.token_ids, self.per_chunk, self.reset, self.drop_after = token_ids, per_chunk, reset, drop_after
        self.hang_up_first = hang_up_first
        self.payloads, self.resets = [], 0
        self.peers = []  # the client's (host, port) of each completion request: which connection it came on
        self.app = web.Application()
        self.app.router.add_get("/health", lambda r: web.Response())
        self.app.router.add_get("/v1/models", lambda r: web.json_response(
            {"data": [{"id": "fake", "root": "/nowhere/fake", "max_model_len": 512}]}))
        self.app.router.add_post("/v1/completions", self.completions)
        if reset:
            self.app.router.add_post("/reset_prefix_cache", self.reset_cache)

    async def reset_cache(self, request):
        self.resets += 1
        return web.json_response({"success": self.resets > 1})  # the first try finds blocks still held

    async def completions(self, request):
        payload = await request.json()
        self.payloads.append(payload)
        self.peers.append(request.transport.get_extra_info("peername"))
        if self.hang_up_first and len(self.payloads) == 1:
            request.transport.close()  # what a kept-alive connection closed by the server looks like to a client
            return web.Response()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        left, sent = payload["max_tokens"], 0
        while left:
            n = min(self.per_chunk, left)
            choice = {"index": 0, "text": " w5" * n, "finish_reason": None if left > n else "length"}
            if self.token_ids:
                choice["token_ids"] = [5] * n
            data = f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
            for i in range(0, len(data), 7):  # split mid-message: the client must reassemble
                await resp.write(data[i:i + 7])
            left, sent = left - n, sent + 1
            if self.drop_after is not None and sent >= self.drop_after:
                request.transport.close()
                return resp
            await asyncio.sleep(0.001)
        usage = {"completion_tokens": payload["max_tokens"], "prompt_tokens": len(payload["prompt"])}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        await asyncio.sleep(0.005)  # as vLLM's server: the body's end comes after [DONE], in a packet of its own
        return resp


def request_record(i, sent, ttft, decode_s=0.1, tokens=5):
    """A request sent at `sent`, its first token `ttft` later (None: none yet), its `tokens` chunks evenly over
    `decode_s`."""
    from optimizer.measurement.metrics import RequestRecord

    r = RequestRecord(index=i, input_len=10, planned_s=sent, sent_s=sent)
    if ttft is not None:
        r.first_token_s = sent + ttft
        r.chunk_times_s = [sent + ttft + decode_s * j / max(tokens - 1, 1) for j in range(tokens)]
        r.output_tokens = tokens
        r.ok = True
    return r
