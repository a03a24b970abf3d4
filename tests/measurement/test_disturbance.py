"""What else ran on the measured CPUs during a trial's replays (measurement/disturbance.py): the counters' arithmetic
by hand, and on this machine a busy loop that is not the trial's own against one that is."""

import subprocess
import sys
import time

import pytest

from optimizer.measurement.disturbance import (
    DISTURBED_CORES, MachineLoad, cpu_seconds, disturbance_text, disturbed, load_summary,
)

STAT = """cpu  900 0 300 5000 10 0 5 40 0 0
cpu0 500 0 200 2000 5 0 3 30 0 0
cpu1 400 0 100 3000 5 0 2 10 0 0
intr 12345
"""


def test_cpu_seconds_add_the_processes_interrupts_and_steal_of_the_cpus_watched():
    # cpu0: user 500 + nice 0 + system 200 = 700 ticks of processes, irq 0 + softirq 3 = 3 of interrupts (idle and
    # iowait left out), 30 of steal
    assert cpu_seconds(STAT, [0], 100.0) == (7.0, 0.03, 0.30)
    assert cpu_seconds(STAT, [0, 1], 100.0) == (7.0 + 5.0, 0.05, 0.40)  # cpu1: 400 + 100 = 500, 2, 10
    assert cpu_seconds(STAT, [], 100.0) == (0.0, 0.0, 0.0)  # the "cpu" total line is never read
    with pytest.raises(ValueError, match="no line for CPUs"):  # a container's /proc/stat numbering its CPUs apart
        cpu_seconds(STAT, [5, 6], 100.0)


def test_the_others_share_is_the_busy_time_less_the_trials_own_in_cores():
    # 40 s of replays: the two CPUs were busy 74 s, the trial's processes took 34 s: others 40 s, a whole core; with
    # 0.4 s of steal, 2 - (74 + 0.4) / 40 = 0.14 of a core was left idle
    s = load_summary(40.0, 74.0, 0.4, 34.0, {1, 0})
    assert s["others_cpu_s"] == 40.0 and s["others_cores"] == 1.0 and s["steal_cores"] == 0.01
    assert s["cpus"] == [0, 1] and s["idle_cores"] == 0.14 and disturbed(s)
    assert disturbance_text(s) == "other processes took 1.00 of a core, the hypervisor 0.01"
    quiet = load_summary(40.0, 80.0, 0.0, 79.5, {0, 1})  # 0.5 s of others: the kernel's threads, a monitor
    assert quiet["others_cores"] == 0.013 and quiet["idle_cores"] == 0.0 and not disturbed(quiet)
    assert load_summary(40.0, 30.0, 0.0, 33.0, {0})["others_cpu_s"] == 0.0  # the counters' ticks: never below 0
    # interrupts (a served run's loopback TCP) are no process's: they only fill the idle time
    served = load_summary(40.0, 76.0, 0.0, 75.6, {0, 1}, irq_s=4.0)
    assert served["others_cores"] == 0.01 and served["idle_cores"] == 0.0 and not disturbed(served)
    # the hypervisor's steal counts with the others: 0.15 + 0.10 of a core reaches the rule's 0.25
    assert disturbed({**quiet, "others_cores": 0.15, "steal_cores": 0.10}) and DISTURBED_CORES == 0.25
    # 64 CPUs: a neighbour's 10 cores beside the trial's 3 leave 51 idle: it took nothing from the trial
    big = load_summary(40.0, 520.0, 0.0, 120.0, range(64))
    assert big["others_cores"] == 10.0 and big["idle_cores"] == 51.0 and not disturbed(big)
    assert disturbed(load_summary(40.0, 2560.0, 0.0, 120.0, range(64)))  # 61 cores of others, none idle: it did
    assert disturbed({"available": True, "others_cores": 0.3})  # a record without idle_cores: others count
    assert not disturbed(None) and not disturbed({"available": False}) and disturbance_text(None) == ""


def test_machine_load_reads_the_counters_before_and_after_the_replays():
    stats = iter([STAT, STAT.replace("cpu0 500", "cpu0 3500").replace("cpu1 400", "cpu1 1400")])  # +40 s busy
    times = iter([10.0, 50.0])
    own = iter([(5.0, {0, 1}), (25.0, {0, 1})])
    with MachineLoad(clock=lambda: next(times), read_stat=lambda: next(stats), tree=lambda pid: next(own),
                     hz=100.0) as load:
        pass
    # 40 s: busy 30 + 10 s more on the two CPUs, the trial 20 s of it: others 20 s, half a core
    s = load.summary()
    assert s["available"] and s["wall_s"] == 40.0 and s["others_cpu_s"] == 20.0 and s["others_cores"] == 0.5

    def no_proc() -> str:
        raise OSError("no /proc/stat")

    with MachineLoad(read_stat=no_proc, tree=lambda pid: (0.0, {0})) as missing:
        pass
    assert missing.summary() == {"available": False, "reason": "OSError: no /proc/stat"} and not disturbed(
        missing.summary())


BUSY = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_a_busy_loop_of_another_process_counts_and_one_of_the_trials_own_does_not():
    # not a descendant: started through a shell that exits at once, so the loop is re-parented away from this tree
    with MachineLoad() as other:
        subprocess.run(["sh", "-c", f"{sys.executable} -c '{BUSY.format(s=1.0)}' >/dev/null 2>&1 &"], check=True)
        time.sleep(3.0)  # it ends inside the window, however late a loaded machine starts it
    # a child of this process: the trial's own (as the engine's processes are)
    with MachineLoad() as mine:
        subprocess.run([sys.executable, "-c", BUSY.format(s=1.0)], check=True)
    assert other.summary()["others_cpu_s"] >= 0.6, other.summary()  # ~1 s of a core, the machine's ticks aside
    assert mine.summary()["own_cpu_s"] >= 0.6, mine.summary()
    assert mine.summary()["others_cpu_s"] < other.summary()["others_cpu_s"] - 0.3, (mine.summary(), other.summary())


def test_an_engine_in_virtual_time_is_never_disturbed():
    """The simulator measures no wall clock: a busy machine must not make its runs count as disturbed."""
    with MachineLoad(virtual_time=True) as load:
        sum(range(10_000))
    assert not disturbed(load.summary()) and "virtual time" in load.summary()["reason"]
