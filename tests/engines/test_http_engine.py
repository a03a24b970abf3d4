"""The HTTP backend: flags, the streaming client against a small honest fake server, and one real vLLM server.

The real-server tests share one server start (~25 s here): a module-scoped scenario records what they assert.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys

import psutil
import pytest
from aiohttp import web

from optimizer.config.workload_spec import WorkloadSpec
from optimizer.core import failures
from optimizer.core.errors import EngineDiedError, UsageError
from optimizer.engines import cpu_layout
from optimizer.engines.http_engine import HttpEngine, RemoteEngine, check_url
from optimizer.engines.server import classify_server_failure
from optimizer.engines.server import BOOL_BOTH, BOOL_TRUE_ONLY, free_port, to_flags
from optimizer.measurement.engine import Engine
from optimizer.measurement.workload import Request, build_workload
from optimizer.search.fitting import cpu_engine_args
from tests.conftest import REPO
from tests.support.fakes import FakeServer

KINDS = {"--enable-prefix-caching": BOOL_BOTH, "--enable-chunked-prefill": BOOL_BOTH,
         "--disable-log-stats": BOOL_TRUE_ONLY}


def test_params_become_vllm_serve_flags():
    flags = to_flags({"max_num_seqs": 16, "enable_prefix_caching": False, "enable_chunked_prefill": True,
                      "disable_log_stats": True, "gpu_memory_utilization": 0.5, "long_prefill_token_threshold": None,
                      "compilation_config": {"mode": 0}}, KINDS)
    assert flags == ["--max-num-seqs", "16", "--no-enable-prefix-caching", "--enable-chunked-prefill",
                     "--disable-log-stats", "--gpu-memory-utilization", "0.5", "--compilation-config", '{"mode": 0}']
    # a store_true flag that is False is vLLM's default: left out rather than spelled as a flag that does not exist
    assert to_flags({"disable_log_stats": False}, KINDS) == []


def test_flags_parse_back_to_the_same_values_with_vllms_own_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from optimizer.engines.server import vllm_flag_kinds

    params = {"max_num_seqs": 24, "max_num_batched_tokens": 4096, "gpu_memory_utilization": 0.3,
              "enable_chunked_prefill": False, "enable_prefix_caching": True, "block_size": 32,
              "long_prefill_token_threshold": 256, "enforce_eager": True, "disable_log_stats": True,
              "max_model_len": 1024}
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m", *to_flags(params, vllm_flag_kinds())])
    assert {k: getattr(ns, k) for k in params} == params
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", "m", *to_flags({"enable_chunked_prefill": True, "enable_prefix_caching": False},
                                   vllm_flag_kinds())])
    assert (ns.enable_chunked_prefill, ns.enable_prefix_caching) == (True, False)


def test_server_failures_are_classified_from_the_log():
    argparse_log = "usage: api_server.py [-h] ...\napi_server.py: error: unrecognized arguments: --bogus 1\n"
    assert classify_server_failure(2, argparse_log)[0] == failures.INVALID_CONFIG
    oom_log = "(EngineCore pid=1) ERROR ... ValueError: Free memory on device cpu (3.2/23.5 GiB) is less than desired"
    assert classify_server_failure(1, oom_log)[0] == failures.OUT_OF_MEMORY


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://h:1", "http://", "http://h:port"])
def test_a_malformed_url_names_the_expected_form(url):
    with pytest.raises(UsageError, match="http://HOST:PORT"):
        check_url(url)


def test_measure_only_on_an_unreachable_url_is_a_usage_error_that_names_the_fix():
    url = f"http://127.0.0.1:{free_port()}"
    engine = RemoteEngine(url, wait_s=0.3)
    with pytest.raises(UsageError) as err:
        asyncio.run(engine.start({}))
    assert url in str(err.value) and "api_server" in str(err.value)
    assert "--" not in str(err.value).replace("--model", "")  # the engine names no flag of ours: the CLI adds it
    asyncio.run(engine.shutdown())  # nothing to end, and safe


@pytest.mark.parametrize("args,expected", [
    (["--url", "http://127.0.0.1:{port}", "--rate", "5"], "no vLLM server answers"),
    (["--url", "http://127.0.0.1:{port}", "--rate", "5"], "(--url)"),
    (["--url", "http://127.0.0.1:{port}", "--rate", "-2"], "--rate '-2' is not a rate"),
    (["--url", "http://127.0.0.1:{port}", "--rate", "5,fast"], "--rate 'fast' is not a rate"),
    (["--url", "localhost", "--rate", "5"], "http://HOST:PORT"),
    (["--url", "localhost", "--rate", "5"], "--url 'localhost' is not a server URL"),
])
def test_measure_command_bad_input_exits_2_with_the_fix(args, expected):
    port = free_port()
    argv = [a.format(port=port) for a in args] + ["--wait", "0.5s"]
    proc = subprocess.run([sys.executable, "-m", "optimizer", "measure", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr


# --- the client against a fake server: aiohttp.web speaking the completions stream of vLLM ---

async def _with_fake(fake, scenario):
    runner = web.AppRunner(fake.app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        return await scenario(f"http://127.0.0.1:{port}", runner)
    finally:
        await runner.cleanup()


REQ = Request(index=0, prompt_token_ids=(101, 102, 103), output_len=7, unit_arrival_s=0.0)


@pytest.mark.parametrize("token_ids", [True, False])
def test_client_counts_every_token_with_or_without_token_ids(token_ids):
    fake = FakeServer(token_ids=token_ids, per_chunk=3)

    async def scenario(url, runner):
        engine = RemoteEngine(url, wait_s=2)
        assert isinstance(engine, Engine)
        resolved = await engine.start({})
        try:
            chunks = [n async for n in engine.generate(REQ)]
            await engine.reset_prefix_cache()
        finally:
            await engine.shutdown()
        return resolved, chunks

    resolved, chunks = asyncio.run(_with_fake(fake, scenario))
    assert resolved == {"url": resolved["url"], "model": "fake", "max_model_len": 512}
    assert sum(chunks) == 7
    # with token ids: one yield per chunk of 3, 3, 1; without: one per chunk, corrected by the usage total
    assert chunks == ([3, 3, 1] if token_ids else [1, 1, 1, 4])
    sent = fake.payloads[0]
    assert sent["prompt"] == [101, 102, 103] and sent["max_tokens"] == 7 and sent["model"] == "fake"
    assert sent["ignore_eos"] is True and sent["stream"] is True and sent["return_token_ids"] is True
    assert fake.resets == 2  # retried until the server reported success


def test_requests_one_after_another_reuse_one_connection():
    """Each stream is read to its end after [DONE], so aiohttp pools its connection: no connect per request."""
    fake = FakeServer()

    async def scenario(url, runner):
        engine = RemoteEngine(url, wait_s=2)
        await engine.start({})
        try:
            return [sum([n async for n in engine.generate(REQ)]) for _ in range(5)]
        finally:
            await engine.shutdown()

    assert asyncio.run(_with_fake(fake, scenario)) == [7] * 5
    assert len(fake.peers) == 5 and len(set(fake.peers)) == 1, fake.peers


def test_measure_only_runs_on_a_server_without_reset_and_ends_nothing():
    fake = FakeServer(reset=False)

    async def scenario(url, runner):
        engine = RemoteEngine(url, wait_s=2)
        await engine.start({})
        await engine.reset_prefix_cache()  # 404: noted, not an error
        await engine.shutdown()
        await engine.shutdown()
        again = RemoteEngine(url, wait_s=2)  # the server is still there
        await again.start({})
        n = sum([n async for n in again.generate(REQ)])
        await again.shutdown()
        return engine.reset_supported, n, engine.pids

    assert asyncio.run(_with_fake(fake, scenario)) == (False, 7, [])


def test_a_request_on_a_connection_closed_before_any_answer_is_sent_again():
    fake = FakeServer(hang_up_first=True)

    async def scenario(url, runner):
        engine = RemoteEngine(url, wait_s=2)
        await engine.start({})
        try:
            return [n async for n in engine.generate(REQ)]
        finally:
            await engine.shutdown()

    assert sum(asyncio.run(_with_fake(fake, scenario))) == 7
    assert len(fake.payloads) == 2


def test_a_server_that_goes_away_mid_stream_is_an_engine_death():
    fake = FakeServer(drop_after=1)

    async def scenario(url, runner):
        engine = RemoteEngine(url, wait_s=2)
        await engine.start({})
        try:
            gen = engine.generate(REQ)
            assert await gen.__anext__() == 2
            await runner.cleanup()  # the server is gone: /health no longer answers
            with pytest.raises(EngineDiedError):
                async for _ in gen:
                    pass
        finally:
            await engine.shutdown()

    asyncio.run(_with_fake(fake, scenario))


# --- one real vLLM server (CPU build) ---

WORKLOAD = build_workload(WorkloadSpec(num_requests=12, warmup_requests=0, input_len_min=8, input_len_max=40,
                                       output_len_min=3, output_len_max=9, seed=5), 16000)
PARAMS = {"max_num_seqs": 4, "gpu_memory_utilization": 0.2, "enable_prefix_caching": False, "max_model_len": 1024}


def _bindings(pids, of_thread=None):
    """Each live process's name and the CPU sets its threads may run on (or `of_thread(tid)` of each). The engine's
    record also keeps short-lived children of the start (a shell running lscpu, say) that are gone by now: skipped."""
    out = {}
    for pid in pids:
        try:
            name = psutil.Process(pid).name()
        except psutil.NoSuchProcess:
            continue
        threads = cpu_layout.thread_cpus(pid)
        values = set(threads.values()) if of_thread is None else {of_thread(tid) for tid in threads}
        if values:
            out.setdefault(name, set()).update(values)
    return out


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    """Start one server through HttpEngine, use it as the managed engine and in measure-only mode, then kill it."""
    from optimizer.core.clock import MonotonicClock
    from optimizer.measurement.metrics import summarize
    from optimizer.measurement.replay import replay

    log = tmp_path_factory.mktemp("http") / "trial.log"
    out = {}

    async def scenario():
        engine = HttpEngine({"model": str(tiny_model), **cpu_engine_args()})
        try:  # whatever fails, the server ends and this process gets its CPUs back
            out["resolved"] = await engine.start(PARAMS, log)
            out["pids"] = list(engine.pids)
            out["own_cpus"] = frozenset(os.sched_getaffinity(0))
            out["bindings"] = _bindings(engine.pids)
            out["nice"] = _bindings(engine.pids, lambda tid: os.getpriority(os.PRIO_PROCESS, tid))
            out["managed"] = [n async for n in engine.generate(WORKLOAD.requests[0])]
            await engine.reset_prefix_cache()
            remote = RemoteEngine(engine.base_url, wait_s=5)
            out["remote_resolved"] = await remote.start({})
            records = await replay(remote, WORKLOAD.requests, WORKLOAD.arrivals_s(20.0), MonotonicClock())
            out["metrics"] = summarize(records, 20.0)
            out["records"] = records
            await remote.shutdown()
            out["healthy_after_remote_shutdown"] = await engine.healthy()
            out["measure_cmd"] = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "optimizer", "measure", "--url", engine.base_url, "--rate",
                                 "20,inf", "--num-requests", "10", "--input-len", "8:40", "--output-len", "3:9",
                                 "--format", "json"],
                cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
            # the API server dies (kill -9): the next request is an engine death, and shutdown still ends the rest
            os.kill(engine.pids[0], signal.SIGKILL)
            await asyncio.sleep(1.0)
            try:
                [n async for n in engine.generate(WORKLOAD.requests[1])]
                out["after_kill"] = "no error"
            except EngineDiedError as exc:
                out["after_kill"] = exc
        finally:
            await engine.shutdown()
        await engine.shutdown()

    own = os.sched_getaffinity(0)
    asyncio.run(scenario())
    out["log"] = log.read_text()
    out["own_cpus_after"], out["own_cpus_before"] = os.sched_getaffinity(0), own
    return out


@pytest.mark.engine
def test_the_server_runs_the_trials_flags(served):
    r = served["resolved"]
    assert r["max_num_seqs"] == 4 and r["enable_prefix_caching"] is False and r["max_model_len"] == 1024
    assert r["num_kv_blocks"] and r["num_kv_blocks"] > 0
    assert "--no-enable-prefix-caching" in served["log"] and "--max-num-seqs 4" in served["log"]
    assert "EngineCore" in served["log"]  # the server's own output (and its engine core's) is in the trial log
    assert served["remote_resolved"]["max_model_len"] == 1024


@pytest.mark.engine
def test_the_server_and_the_client_keep_off_the_workers_cpus(served):
    assert served["own_cpus_after"] == served["own_cpus_before"]  # the client has its CPUs back
    if len(served["own_cpus_before"]) < 2:
        return  # one CPU: nothing to separate, and the server starts as given
    (worker,) = served["bindings"].pop("VLLM::Worker")
    fronts = set().union(*served["bindings"].values())
    assert len(worker) == 1 and fronts == {served["own_cpus"]} and not worker & served["own_cpus"], served["bindings"]
    command = served["log"].splitlines()[0]  # what a deployment runs to get the same layout
    assert command.startswith("$ ") and f"taskset -c {','.join(map(str, sorted(served['own_cpus'])))} " in command
    assert f"VLLM_CPU_OMP_THREADS_BIND={min(worker)} " in command or os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    # the engine core yields to the API server and the client on their shared CPUs; the rest keep their priority
    nice = dict(served["nice"])
    assert nice.pop("VLLM::EngineCore") == {cpu_layout.SERVED_CORE_NICENESS} and set().union(*nice.values()) == {0}
    assert "optimizer: the engine core (pid " in served["log"] and "renice -n 10" in served["log"]


@pytest.mark.engine
def test_measure_only_replay_counts_exact_tokens_on_the_real_server(served):
    assert sum(served["managed"]) == WORKLOAD.requests[0].output_len
    m = served["metrics"]
    assert m.completed == len(WORKLOAD.requests) and m.failed == 0
    assert sorted(r.output_tokens for r in served["records"]) == sorted(r.output_len for r in WORKLOAD.requests)
    assert all(r.ttft_s > 0 for r in served["records"])
    assert m.ttft.p99_ms < 30_000 and m.output_throughput_tok_s > 0
    assert served["healthy_after_remote_shutdown"] is True  # measure-only ends nothing


@pytest.mark.engine
def test_optimize_measure_replays_the_workload_against_the_running_server(served):
    proc = served["measure_cmd"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert [r["rate_rps"] for r in rows] == [20.0, None]  # JSON has no inf: the burst is null
    assert all(r["completed"] == 10 and r["failed"] == 0 for r in rows)
    assert all(r["ttft_p99_ms"] > 0 and r["output_tok_s"] > 0 for r in rows)


@pytest.mark.engine
def test_a_dead_server_is_an_engine_death_and_no_process_outlives_shutdown(served):
    assert isinstance(served["after_kill"], EngineDiedError), served["after_kill"]
    assert len(served["pids"]) >= 2  # the API server and its engine core at least
    for pid in served["pids"]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
