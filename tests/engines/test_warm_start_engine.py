"""A warm start against vLLM's own on the real CPU engine: the forked engine's processes are the spawned one's (titles,
the worker's CPU binding, the trial's log), the fork server is not one of them and outlives them."""

from __future__ import annotations

import asyncio
import os

import psutil
import pytest

from optimizer.engines import warm_start
from optimizer.engines.allocator import find_tcmalloc
from optimizer.engines.vllm_engine import VllmEngine
from optimizer.search.fitting import cpu_engine_args
from tests.engines.test_engine_contract import START_PARAMS, WORKLOAD, collect

pytestmark = pytest.mark.engine


def _bindings(pids: list[int]) -> list[tuple[str, list[str]]]:
    """Per process: its title and the distinct CPU lists its threads may run on."""
    out = []
    for pid in pids:
        threads = os.listdir(f"/proc/{pid}/task")
        cpus = {open(f"/proc/{pid}/task/{t}/status").read().split("Cpus_allowed_list:")[1].split()[0] for t in threads}
        out.append((psutil.Process(pid).name(), sorted(cpus)))
    return out


def test_a_warm_engine_runs_as_vllms_spawned_one(tiny_model, tmp_path):
    allocators: list[list[bool]] = []  # per start: whether each of the engine's processes maps a tcmalloc

    async def one(warm: bool, name: str):
        engine = VllmEngine({"model": str(tiny_model), **cpu_engine_args()}, warm_starts=warm)
        own = os.sched_getaffinity(0)
        resolved = await engine.start(START_PARAMS, tmp_path / f"{name}.log")
        try:
            seen = _bindings([*engine.pids, os.getpid()]), [psutil.Process(p).ppid() for p in engine.pids]
            allocators.append(["libtcmalloc" in open(f"/proc/{p}/maps").read() for p in engine.pids])
            outs = await asyncio.gather(*(collect(engine, r) for r in WORKLOAD.requests))
            assert [sum(o) for o in outs] == [r.output_len for r in WORKLOAD.requests]
        finally:
            await engine.shutdown()
        assert os.sched_getaffinity(0) == own  # this process has its CPUs back
        return engine.pids, seen, resolved

    cold_pids, (cold, _), cold_config = asyncio.run(one(False, "cold"))
    warm_pids, (warm, warm_parents), warm_config = asyncio.run(one(True, "warm"))
    again_pids, (again, again_parents), _ = asyncio.run(one(True, "again"))
    server = warm_start.server_pid()

    log = (tmp_path / "warm.log").read_text()
    # where the machine has a tcmalloc, the engine's processes run on it, cold or warm (optimizer/engines/allocator.py)
    has = find_tcmalloc() is not None
    assert allocators == [[has] * len(cold_pids), [has] * len(warm_pids), [has] * len(again_pids)], allocators
    said = [line for line in (tmp_path / "cold.log").read_text().splitlines() if "processes allocate with" in line]
    assert len(said) == 1 and ("tcmalloc" in said[0]) == has and ("glibc's malloc" in said[0]) == (not has), said
    config = VllmEngine({"model": str(tiny_model), **cpu_engine_args()}).engine_config(START_PARAMS)
    cpus = warm_start.worker_cpus(config)
    if cpus is None or any(len(c) > 1 for c in cpus):
        # a machine where vLLM gives the worker several OpenMP threads: the start stays cold, and the log says why
        assert "optimizer: cold start" in log and warm == cold
        return
    assert "optimizer: warm start" in log and "optimizer: cold start" not in (tmp_path / "again.log").read_text()
    assert "optimizer: warm start" not in (tmp_path / "cold.log").read_text()
    # the forked core and worker write to the trial's log, as spawned ones do
    assert "(EngineCore pid=" in log and "(Worker pid=" in log
    # the same processes, titled and bound alike: the worker on its one CPU in every thread; the core and this
    # process, every thread, on the CPUs the worker leaves (optimizer/engines/cpu_layout.py)
    assert [t for t, _ in warm] == [t for t, _ in cold] == [t for t, _ in again]
    assert [t for t, _ in cold][:2] == ["VLLM::EngineCore", "VLLM::Worker"]
    assert warm == cold == again, (warm, cold)
    (_, core), (_, worker), (_, front) = cold
    if len(os.sched_getaffinity(0)) > 1:
        assert len(worker) == 1 and core == front and worker[0] not in core[0].split(","), cold
        assert "optimizer: the engine core and the front end run on CPUs" in log
    assert warm_config["max_num_seqs"] == cold_config["max_num_seqs"] == 4
    # the fork server is none of the engine's processes, and outlives them; the engine's are gone
    assert server is not None and server not in warm_pids + again_pids
    assert psutil.Process(server).ppid() == os.getpid()
    # the core forked from the fork server, the worker from the core
    assert warm_parents == [server, warm_pids[0]] and again_parents == [server, again_pids[0]]
    for pid in cold_pids + warm_pids + again_pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
