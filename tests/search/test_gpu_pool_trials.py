"""Trials of different layouts run at once on a pool of GPUs: each gets exactly its layout's GPUs, none shares one,
and a GPU another program uses stops the run without pruning the config. The study is real (SQLite, Optuna's own
threads running trials at once); the engine is the fake one, the GPUs logical or a fake NVML's."""

import itertools
import multiprocessing
import os

import optuna
import pytest
from optuna.trial import TrialState

from optimizer.config.settings import StudyConfig
from optimizer.config.workload_spec import WorkloadSpec
from optimizer.hardware.gpu_guard import GpuInUseError
from optimizer.hardware.gpu_pool import GpuPool, logical_topology, read_topology
from optimizer.params.space import parse_space_yaml
from optimizer.search.attrs import GPUS, PRUNED_DETAIL, PRUNED_REASON
from optimizer.search.progress import describe
from optimizer.search.recovery import RUN_ENV
from optimizer.search.runner import prepare
from optimizer.search.slots import BudgetGate
from optimizer.search.budget import run_to_budget
from tests.support.fake_engine import FakeEngine
from tests.support.fake_nvml import FakeNvml


def objective_on(tmp_path, model, pool, name="pool"):
    space = parse_space_yaml({"tensor_parallel_size": [1, 2, 4, 8], "max_num_seqs": [8, 16],
                              "gpu_memory_utilization": 0.8}).model_dump()  # the fake engine refuses over 0.9
    config = StudyConfig(study_name=name, storage_url=f"sqlite:///{tmp_path}/{name}.db", ttft_p99_ms=200.0,
                         budget=8, model=str(model), dummy_weights=True, device="cuda", space=space,
                         workload=WorkloadSpec(num_requests=12, warmup_requests=0, input_len_min=16,
                                               input_len_max=32, output_len_min=2, output_len_max=4))
    prepared = prepare(config, tmp_path, say=lambda *a: None, engine_factory=FakeEngine, memory_probe=lambda: None)
    prepared.objective.gpu_pool = pool
    prepared.objective.memory_wait_s, prepared.objective.memory_poll_s = 1.0, 0.05
    return prepared.objective, prepared.study


def _slot(tmp_path, model, budget):
    """One slot of the pool: a process of its own running trials until the study holds `budget`, as `--gpus` runs
    one per GPU."""
    obj, study = objective_on(tmp_path, model, GpuPool(logical_topology(8), tmp_path / "locks"))
    run_to_budget(study, obj, budget, gate=BudgetGate(tmp_path / "budget.lock"))  # as --gpus gives its slots


@pytest.mark.filterwarnings("ignore")
def test_trials_of_1_2_and_4_gpus_share_no_gpu_and_run_at_once(tmp_path, config_only_model, monkeypatch):
    monkeypatch.setenv(RUN_ENV, "run-1")  # the slots are one run's: they share its SQLite file
    obj, study = objective_on(tmp_path, config_only_model, GpuPool(logical_topology(8), tmp_path / "locks"))
    layouts = [4, 2, 1, 1, 2, 4, 1, 2, 8]
    for tp in layouts:
        study.enqueue_trial({"tensor_parallel_size": tp, "max_num_seqs": 16})
    ctx = multiprocessing.get_context("spawn")
    slots = [ctx.Process(target=_slot, args=(tmp_path, config_only_model, len(layouts) + 1)) for _ in range(4)]
    for p in slots:
        p.start()
    for p in slots:
        p.join(240)
        assert p.exitcode == 0
    study = optuna.load_study(study_name="pool", storage=f"sqlite:///{tmp_path}/pool.db")
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    tp = {t.number: t.params.get("tensor_parallel_size", 1) for t in done}  # vLLM's defaults: 1 GPU
    queued = [tp[t.number] for t in done if t.number <= len(layouts)]  # vLLM's defaults, then the queued layouts
    assert sorted(queued) == sorted([1, *layouts])  # each once, none twice
    held = {t.number: GPUS.of(t) for t in done}
    for t in done:  # exactly its layout's GPUs, close: a 4-GPU trial on one NVLink island of the 8-GPU layout
        assert len(held[t.number]["indices"]) == tp[t.number]
        if tp[t.number] == 4:
            assert len({i // 4 for i in held[t.number]["indices"]}) == 1
    overlapped = 0
    for a, b in itertools.combinations(done, 2):
        ha, hb = held[a.number], held[b.number]
        at_once = ha["reserved_unix_s"] < hb["released_unix_s"] and hb["reserved_unix_s"] < ha["released_unix_s"]
        if at_once:
            overlapped += 1
            assert not set(ha["indices"]) & set(hb["indices"]), (a.number, b.number, ha, hb)
    assert overlapped >= 3  # trials did run at once
    line = describe(done[0])
    assert f"on GPU{'s' if len(held[done[0].number]['indices']) > 1 else ''} " in line


@pytest.mark.filterwarnings("ignore")
def test_a_layout_larger_than_the_pool_is_pruned_with_its_reason(tmp_path, config_only_model):
    obj, study = objective_on(tmp_path, config_only_model, GpuPool(logical_topology(4), tmp_path / "locks"))
    study.enqueue_trial({"tensor_parallel_size": 8, "max_num_seqs": 16})
    study.optimize(obj, n_trials=2, catch=())  # vLLM's defaults, then the 8-GPU layout
    t = study.trials[-1]
    assert t.state == TrialState.PRUNED and PRUNED_REASON.of(t) == "invalid_config"
    assert "needs 8 GPUs" in PRUNED_DETAIL.of(t) and "gives it 4" in PRUNED_DETAIL.of(t)


@pytest.mark.filterwarnings("ignore")
def test_a_gpu_another_program_uses_stops_the_run_and_prunes_nothing(tmp_path, config_only_model):
    nvml = FakeNvml(devices=FakeNvml().devices[:2], processes={0: [(4242, "train.py", 30 * 1024**3)]})
    pool = GpuPool(read_topology(range(2), nvml, allowed_cpus=[0]), tmp_path / "locks")
    obj, study = objective_on(tmp_path, config_only_model, pool)
    obj.nvml = nvml
    study.enqueue_trial({"tensor_parallel_size": 1, "max_num_seqs": 16})
    with pytest.raises(GpuInUseError, match="pid 4242 .train.py, 30.0 GiB. on GPU 0"):
        study.optimize(obj, n_trials=1, catch=())
    t = study.trials[0]
    assert t.state == TrialState.FAIL and PRUNED_REASON.of(t) is None  # queued again on a resume, not learned from
    both = pool.try_reserve(2)
    assert both is not None  # its GPU was given back
    both.release()
    nvml.processes.clear()  # the other program is gone: the next trial runs, its engine shown GPU 0 alone
    seen = []

    class Recording(FakeEngine):
        async def start(self, params, log_path=None):
            seen.append(os.environ.get("CUDA_VISIBLE_DEVICES"))
            return await super().start(params, log_path)

    obj.engine_factory = Recording
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    study.optimize(obj, n_trials=1, catch=())  # the queued one-GPU trial
    t = study.trials[1]
    assert t.state == TrialState.COMPLETE and GPUS.of(t)["indices"] == [0]
    assert seen == [FakeNvml.uuid(0)] and os.environ.get("CUDA_VISIBLE_DEVICES") == before
