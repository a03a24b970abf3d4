"""One contract, every Engine implementation: the fake, the simulator, the real vLLM CPU engine in process and over
HTTP, and the measure-only engine on a server someone else runs (a fake OpenAI server here)."""

import asyncio
import os
import threading

import psutil
import pytest
from aiohttp import web

from optimizer.config.workload_spec import WorkloadSpec
from optimizer.core import failures
from optimizer.core.errors import EngineStartError
from tests.support.fake_engine import FakeEngine
from optimizer.engines.server import free_port
from optimizer.measurement.engine import Engine
from optimizer.measurement.workload import build_workload
from optimizer.search.fitting import cpu_engine_args
from tests.support.fakes import FakeServer

WORKLOAD = build_workload(WorkloadSpec(num_requests=10, warmup_requests=0, input_len_min=8, input_len_max=40,
                                       output_len_min=3, output_len_max=7, seed=3), 16000)
OOM_PARAMS = {"gpu_memory_utilization": 0.99}


START_PARAMS = {"max_num_seqs": 4, "gpu_memory_utilization": 0.2}


@pytest.fixture
def running_server():
    """A fake vLLM OpenAI server on its own thread and event loop, as a deployment would be: its URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(FakeServer().app)
    port = free_port()
    up = threading.Event()

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        up.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert up.wait(10)
    yield f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture(params=["fake", "watched", "simulated", "remote", pytest.param("vllm", marks=pytest.mark.engine),
                        pytest.param("http", marks=pytest.mark.engine)])
def make_engine(request):
    if request.param == "fake":
        return lambda: FakeEngine(max_memory_fraction=0.95)
    if request.param == "watched":  # what every trial drives: an engine under watch (measurement/engine_watch.py)
        from optimizer.measurement.engine_watch import WatchedEngine

        return lambda: WatchedEngine(FakeEngine(max_memory_fraction=0.95))
    if request.param == "remote":
        from optimizer.engines.http_engine import RemoteEngine

        url = request.getfixturevalue("running_server")
        return lambda: RemoteEngine(url, wait_s=5)
    if request.param == "simulated":
        from optimizer.engines.simulated import SimulatedEngine
        from optimizer.config.model import DEFAULT_MODEL_CONFIG, model_info
        from optimizer.engines.sim.steptime import StepTimeModel

        quick = StepTimeModel(fixed_s=0.001, prefill_token_s=1e-6, decode_seq_s=1e-4, context_token_s=0.0)
        return lambda: SimulatedEngine(model_info(DEFAULT_MODEL_CONFIG, "sim"), quick)
    tiny = request.getfixturevalue("tiny_model")
    if request.param == "http":
        from optimizer.engines.http_engine import HttpEngine

        return lambda: HttpEngine({"model": str(tiny), **cpu_engine_args()})
    from optimizer.engines.vllm_engine import VllmEngine

    return lambda: VllmEngine({"model": str(tiny), **cpu_engine_args()})


async def collect(engine, request):
    return [n async for n in engine.generate(request)]


def test_lifecycle(make_engine, tmp_path):
    async def scenario():
        engine: Engine = make_engine()
        assert isinstance(engine, Engine)
        shm_before = set(os.listdir("/dev/shm"))
        resolved = await engine.start({} if engine.measure_only else START_PARAMS, tmp_path / "e.log")
        pids = list(engine.pids)
        try:
            assert [r.pid for r in engine.process_refs] == pids
            if not engine.measure_only:
                assert resolved["max_num_seqs"] == 4
            sockets = getattr(engine, "sockets_dir", None)  # engines that start vLLM processes have one
            if hasattr(engine, "sockets_dir"):
                assert sockets is not None and any(p.is_socket() for p in sockets.iterdir())  # vLLM's, in it
            one = await collect(engine, WORKLOAD.requests[0])
            assert sum(one) == WORKLOAD.requests[0].output_len and all(n > 0 for n in one)
            await engine.reset_prefix_cache()
            # more requests than max_num_seqs at once: all complete, each with exactly its tokens
            outs = await asyncio.gather(*(collect(engine, r) for r in WORKLOAD.requests))
            assert [sum(o) for o in outs] == [r.output_len for r in WORKLOAD.requests]
        finally:
            await engine.shutdown()
        await engine.shutdown()  # twice is safe
        # the engine's message queues (shared memory, 160-420 MB on the CPU build) do not outlive it
        assert {n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("psm_")} == set()
        # nor do the socket files of its processes, ended by PID before they could close them
        assert sockets is None or not sockets.exists()
        return pids

    pids = asyncio.run(scenario())
    assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)


def test_config_that_does_not_fit_fails_with_reason_and_leaves_no_process(make_engine, tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}

    async def scenario():
        engine = make_engine()
        with pytest.raises(EngineStartError) as err:
            await engine.start(OOM_PARAMS, tmp_path / "oom.log")
        await engine.shutdown()
        return engine, err.value

    engine, err = asyncio.run(scenario())
    # a measure-only engine runs no config at all: any parameters are refused as such
    assert err.reason == (failures.INVALID_CONFIG if engine.measure_only else failures.OUT_OF_MEMORY), str(err)
    after = {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}
    assert after <= before | _resource_tracker() | _fork_server()


def test_unknown_argument_is_an_invalid_config(make_engine, tmp_path):
    async def scenario():
        engine = make_engine()
        with pytest.raises(EngineStartError) as err:
            await engine.start({"unknown_arg": 1}, tmp_path / "bad.log")
        await engine.shutdown()
        return err.value

    assert asyncio.run(scenario()).reason == failures.INVALID_CONFIG


def _resource_tracker() -> set[int]:
    from multiprocessing import resource_tracker

    pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    return {pid} if pid else set()


def _fork_server() -> set[int]:
    """The warm starts' fork server (optimizer/engines/warm_start.py): it outlives engines by design."""
    from optimizer.engines.warm_start import server_pid

    pid = server_pid()
    return {pid} if pid else set()


def test_validate_refuses_what_start_would_without_starting_anything(make_engine, tmp_path):
    """`validate` is the cheap check the objective runs before a start: an unknown argument fails there with the
    same reason `start` gives, and a config the engine runs passes, with no process started either way."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    engine = make_engine()
    with pytest.raises(EngineStartError) as err:
        engine.validate({"unknown_arg": 1})
    assert err.value.reason == failures.INVALID_CONFIG
    engine.validate({} if engine.measure_only else START_PARAMS)
    assert engine.pids == [] and engine.process_refs == []
    after = {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}
    assert after <= before | _resource_tracker()
