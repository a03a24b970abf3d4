"""The memory estimate on hand-computed numbers, and the sampler learning an infeasible region."""

import optuna
import pytest

from optimizer.model import ModelInfo
from optimizer.preflight import GIB, DeviceMemory, estimate, memory_problems

# 2 layers x 4 KV heads x 64 dims x 2 bytes x (K and V) = 2048 bytes per token
MODEL = ModelInfo(path="m", vocab_size=1000, max_len=4096, num_layers=2, num_kv_heads=4, head_dim=64,
                  dtype_bytes=2, weights_bytes=1 * GIB)
MEM = DeviceMemory(total_bytes=10 * GIB, available_bytes=8 * GIB)


def test_kv_bytes_per_token():
    assert MODEL.kv_bytes_per_token == 2048


def test_fitting_config_has_no_problems():
    est = estimate({"gpu_memory_utilization": 0.5, "max_model_len": 4096}, MODEL, "cuda", MEM, 1024)
    assert est.requested_bytes == 5 * GIB
    assert est.kv_budget_bytes == 5 * GIB - 1 * GIB - 1 * GIB  # weights and the CUDA runtime reserve
    assert est.kv_one_sequence_bytes == 2048 * 4096
    assert est.sequences_that_fit == pytest.approx(3 * GIB / (2048 * 1024))
    assert memory_problems(est) == []


def test_more_than_is_free_is_rejected_with_the_fix():
    problems = memory_problems(estimate({"gpu_memory_utilization": 0.9}, MODEL, "cuda", MEM, 1024))
    assert len(problems) == 1 and "only 8.00 GiB are free: lower it" in problems[0]


def test_no_room_for_kv_cache():
    problems = memory_problems(estimate({"gpu_memory_utilization": 0.2}, MODEL, "cuda", MEM, 1024))
    assert problems and "no room for the KV cache" in problems[0]


def test_one_sequence_must_fit():
    big = ModelInfo(**{**MODEL.__dict__, "num_layers": 2000})  # 2 MB per token
    problems = memory_problems(estimate({"gpu_memory_utilization": 0.5, "max_model_len": 4096}, big, "cuda", MEM,
                                        512))
    assert problems and "lower max_model_len" in problems[0]


def test_tpe_learns_to_avoid_an_infeasible_region():
    """Pruned trials with a violated constraint steer TPE away: infeasible proposals become rarer."""
    sampler = optuna.samplers.TPESampler(seed=0, n_startup_trials=10, multivariate=True, constant_liar=True)
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)

    def objective(trial):
        x = trial.suggest_float("gpu_memory_utilization", 0.5, 1.0)
        y = trial.suggest_int("max_num_seqs", 1, 256, log=True)
        if x > 0.8:  # "out of memory": pruned, constraint violated, as the objective does
            trial.set_constraint("c", 1e7)
            raise optuna.TrialPruned()
        trial.set_constraint("c", 0.0)
        return x * y, 1.0 / y

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(objective, n_trials=60)
    infeasible = [t.params["gpu_memory_utilization"] > 0.8 for t in study.trials]
    early, late = sum(infeasible[:20]) / 20, sum(infeasible[40:]) / 20
    assert late < early
    assert late <= 0.2


def test_cpu_keeps_headroom_for_the_rest_of_the_machine():
    mem = DeviceMemory(total_bytes=24 * GIB, available_bytes=22 * GIB)
    # vLLM's default 0.92 of 24 GiB = 22.08 GiB: more than is free once 2.4 GiB stay for everything else
    problems = memory_problems(estimate({}, MODEL, "cpu", mem, 256))
    assert problems and "keeping 2.40 GiB for the rest of the machine" in problems[0]
    assert memory_problems(estimate({"gpu_memory_utilization": 0.5}, MODEL, "cpu", mem, 256)) == []
