"""The GPU pool: which GPUs `--gpus` names, how close a group is on NVML's topology, and reservations that separate
processes never share (real `flock` locks, real processes)."""

import asyncio
import multiprocessing
import os
import signal
import time

import pytest

from optimizer.core.errors import UsageError
from optimizer.hardware.gpu_guard import GpuInUseError, foreign_processes, wait_until_unused
from optimizer.hardware.gpu_pool import (ACROSS_HOST, NVLINK, GpuPool, PoolTooSmallError, choose_group,
                                         logical_topology, parse_gpus, read_topology, share_cores)
from tests.support.fake_nvml import FakeNvml

# an 8-GPU server as DGX-like hosts are built: two NVLink islands of four, each on its own NUMA node and socket
SERVER = dict(nvlink=[range(4), range(4, 8)], numa=[0] * 4 + [1] * 4,
              affinity=[range(0, 16)] * 4 + [range(16, 32)] * 4)


@pytest.mark.parametrize("spec, expected", [("all", list(range(8))), ("4", [0, 1, 2, 3]), ("0-3,6", [0, 1, 2, 3, 6]),
                                            ("5-7", [5, 6, 7]), ("2,2,3", [2, 3]), ("1", [0])])
def test_gpus_names_all_a_count_or_indices(spec, expected):
    assert parse_gpus(spec, 8) == expected


@pytest.mark.parametrize("spec, fix", [("9", "ask for 1 to 8"), ("0-8", "no GPU 8"), ("3-1", "write 1-3"),
                                       ("gpu0", "not a GPU list"), ("0", "ask for 1 to 8")])
def test_a_bad_gpus_list_names_the_fix(spec, fix):
    with pytest.raises(UsageError, match=fix):
        parse_gpus(spec, 8)


def test_the_topology_is_read_from_nvml():
    nvml = FakeNvml(**SERVER)
    topo = read_topology(range(8), nvml, allowed_cpus=range(32))
    assert topo.distance(0, 3) == NVLINK and topo.distance(4, 7) == NVLINK
    assert topo.distance(0, 4) == 50  # NVML_TOPOLOGY_SYSTEM: across the sockets
    assert [g.numa_node for g in topo.gpus] == SERVER["numa"]
    assert topo.gpus[2].uuid == FakeNvml.uuid(2)
    # the 16 cores of a socket are dealt out among its four GPUs: no two GPUs share a core
    cores = [set(g.cpus) for g in topo.gpus]
    assert all(len(c) == 4 for c in cores) and len(set().union(*cores)) == 32
    assert cores[0] <= set(range(16)) and cores[5] <= set(range(16, 32))
    assert nvml.initialized == 0  # NVML shut down again


def test_an_nvml_that_cannot_say_leaves_the_topology_unknown():
    topo = read_topology(range(2), FakeNvml(devices=FakeNvml().devices[:2]), allowed_cpus=[0, 1])
    assert topo.distance(0, 1) == ACROSS_HOST and [g.numa_node for g in topo.gpus] == [-1, -1]
    assert [g.cpus for g in topo.gpus] == [(0,), (1,)]  # no affinity known: the process's cores, dealt out


def test_cores_several_gpus_share_are_dealt_out():
    assert share_cores({0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}) == {0: (0, 2), 1: (1, 3)}
    assert share_cores({0: [0], 1: [0], 2: [5]}) == {0: (0,), 1: (0,), 2: (5,)}  # one core: each keeps one


def test_a_group_is_chosen_within_an_nvlink_island():
    topo = read_topology(range(8), FakeNvml(**SERVER), allowed_cpus=range(32))
    assert choose_group(topo, range(8), 4) == (0, 1, 2, 3)
    # two GPUs taken from the first island: a 4-GPU trial goes to the whole second one, not across sockets
    assert choose_group(topo, [2, 3, 4, 5, 6, 7], 4) == (4, 5, 6, 7)
    # a pair where an island has two left, rather than one GPU from each
    assert choose_group(topo, [0, 4, 5, 6], 2) == (4, 5)
    assert choose_group(topo, [0, 4], 2) == (0, 4)  # only across: so be it
    assert choose_group(topo, [0, 1], 3) is None


def test_a_large_pool_is_grouped_greedily_and_still_close():
    topo = logical_topology(64, per_numa_node=8)
    group = choose_group(topo, range(3, 64), 8)
    assert group is not None and len({i // 8 for i in group}) == 1


def _hold(lock_dir, size, ready):
    pool = GpuPool(logical_topology(4), lock_dir)
    got = pool.try_reserve(size)
    ready.put(None if got is None else list(got.indices))
    time.sleep(120)  # holds them until killed


def test_processes_never_share_a_gpu_and_a_killed_holder_gives_them_back(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    holder = ctx.Process(target=_hold, args=(tmp_path, 2, ready))
    holder.start()
    try:
        held = ready.get(timeout=60)
        assert held == [0, 1]
        pool = GpuPool(logical_topology(4), tmp_path)
        mine = pool.try_reserve(2)
        assert mine is not None and set(mine.indices) == {2, 3}
        assert pool.try_reserve(1) is None  # all four are held now
        mine.release()
        again = pool.try_reserve(1)
        assert again is not None and again.indices[0] in (2, 3)
        again.release()
        os.kill(holder.pid, signal.SIGKILL)  # a worker lost mid-trial: the OS drops its locks with it
        holder.join(30)
        everything = pool.try_reserve(4)
        assert everything is not None and everything.indices == (0, 1, 2, 3)
        assert everything.env["CUDA_VISIBLE_DEVICES"].count("GPU-logical-") == 4
        everything.release()
    finally:
        if holder.is_alive():
            holder.kill()
        holder.join(30)


def test_a_trial_waits_for_gpus_another_trial_gives_back(tmp_path):
    pool = GpuPool(logical_topology(2), tmp_path)
    first = pool.try_reserve(2)
    slept = []

    async def sleep(s):  # another trial finishes while this one waits
        slept.append(s)
        first.release()

    got = asyncio.run(pool.reserve(1, poll_s=0.5, sleep=sleep))
    assert slept == [0.5] and len(got.gpus) == 1
    with pytest.raises(PoolTooSmallError, match="needs 4 GPUs, the pool has 2"):
        pool.try_reserve(4)


def test_a_gpu_another_program_uses_is_waited_for_then_refused_naming_it():
    nvml = FakeNvml(processes={1: [(4242, "/usr/bin/python3", 10 * 1024**3), (777, "vllm", 5 * 1024**3)]})
    topo = read_topology(range(2), nvml, allowed_cpus=[0, 1])
    ours = {777}.__contains__  # this study's engine, on the same GPU, does not count
    found = foreign_processes(nvml, topo.gpus, ours)
    assert [(p.gpu_index, p.pid, p.name) for p in found] == [(1, 4242, "python3")]
    assert foreign_processes(nvml, topo.gpus[:1], ours) == []
    clock = [0.0]

    async def sleep(s):
        clock[0] += s

    with pytest.raises(GpuInUseError) as err:
        asyncio.run(wait_until_unused(nvml, topo.gpus, ours, wait_s=60, poll_s=5, now_s=lambda: clock[0],
                                      sleep=sleep))
    assert clock[0] == 60
    line = str(err.value)
    assert "\n" not in line and "pid 4242 (python3, 10.0 GiB) on GPU 1" in line and "--gpus" in line

    async def leaves(s):  # the other program exits while the trial waits: it goes on
        nvml.processes.clear()

    asyncio.run(wait_until_unused(nvml, topo.gpus, ours, wait_s=60, poll_s=5, now_s=time.monotonic, sleep=leaves))
