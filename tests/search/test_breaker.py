"""The circuit breaker: starts that fail for the machine's reason (CUDA initialized before the fork, a missing
library) stop the run after a streak, with the log's excerpt and the fix, instead of burning the budget; the
baseline is measured on the next run. Starts that fail for their config never trip it."""

import pytest
from optuna.trial import TrialState

from optimizer.core import failures
from optimizer.core.errors import EngineStartError
from optimizer.search.breaker import (
    CAUSES, STREAK_LIMIT, EnvironmentBrokenError, StartFailureBreaker, environment_cause,
)
from optimizer.search.score import baseline
from tests.support.fakes import SimEngine, make_config, run_study

# What vLLM's engine core prints when CUDA was initialized in the parent before it was forked (vLLM 0.32, V1).
CUDA_FORK_LOG = """\
(EngineCore_DP0 pid=4242) ERROR 12-01 09:00:00 [core.py:1012] EngineCore failed to start.
(EngineCore_DP0 pid=4242) ERROR 12-01 09:00:00 [core.py:1012] Traceback (most recent call last):
(EngineCore_DP0 pid=4242) ERROR 12-01 09:00:00 [core.py:1012]   File "vllm/v1/worker/gpu_worker.py", line 212, in init_device
(EngineCore_DP0 pid=4242) ERROR 12-01 09:00:00 [core.py:1012]     torch.cuda.set_device(self.device)
(EngineCore_DP0 pid=4242) ERROR 12-01 09:00:00 [core.py:1012] RuntimeError: Cannot re-initialize CUDA in forked \
subprocess. To use CUDA with multiprocessing, you must use the 'spawn' start method
"""
MISSING_LIB_LOG = "ImportError: libcudart.so.12: cannot open shared object file: No such file or directory\n"
CONFIG_LOG = "ValueError: max_num_batched_tokens (32) must be greater than or equal to max_num_seqs (64)\n"


def broken_engine(log_text, starts):
    class Broken(SimEngine):
        async def start(self, params, log_path=None):
            starts.append(params)
            if log_path is not None:
                log_path.parent.mkdir(parents=True, exist_ok=True)
                log_path.write_text(log_text)
            reason, detail = failures.classify("RuntimeError: Engine core initialization failed. See root cause "
                                               "above.", log_text)
            raise EngineStartError(detail, reason, log_excerpt=log_text)
    return Broken


def test_each_cause_is_recognized_in_real_log_lines():
    assert environment_cause(CUDA_FORK_LOG).name == "cuda_initialized_before_fork"
    assert environment_cause(MISSING_LIB_LOG).name == "missing_library"
    assert environment_cause("RuntimeError: No CUDA GPUs are available").name == "no_gpu"
    assert environment_cause(CONFIG_LOG) is None
    assert all(c.fix.endswith("run the same command again to resume") for c in CAUSES)


def test_the_streak_counts_one_cause_and_resets():
    cuda, lib = environment_cause(CUDA_FORK_LOG), environment_cause(MISSING_LIB_LOG)
    b = StartFailureBreaker(limit=3)
    assert not b.observe(cuda) and not b.observe(cuda)
    assert not b.observe(lib)  # another cause starts a new streak
    assert not b.observe(None) and b.streak == 0  # a start that worked
    assert [b.observe(cuda) for _ in range(3)] == [False, False, True]


def test_a_broken_machine_stops_the_run_with_the_log_and_the_fix(tmp_path, config_only_model):
    starts = []
    config = make_config(tmp_path, config_only_model, budget=20)
    with pytest.raises(EnvironmentBrokenError) as info:
        run_study(tmp_path, config, engine=broken_engine(CUDA_FORK_LOG, starts))
    message = str(info.value)
    assert f"{STREAK_LIMIT} engine starts in a row failed" in message
    assert "CUDA was initialized in the parent process" in message and "VLLM_WORKER_MULTIPROC_METHOD=spawn" in message
    assert "  | (EngineCore_DP0 pid=4242) ERROR" in message and "Cannot re-initialize CUDA" in message
    assert info.value.exit_code == 1
    assert len(starts) == STREAK_LIMIT  # not 20

    import optuna
    study = optuna.load_study(study_name=config.study_name, storage=config.storage_url)
    states = [t.state for t in study.trials]
    assert states == [TrialState.PRUNED] * (STREAK_LIMIT - 1) + [TrialState.FAIL]  # the last one is not counted
    assert study.trials[0].user_attrs["baseline"] and baseline(study) is None  # no measurement of the defaults

    resumed = run_study(tmp_path, config.model_copy(update={"budget": STREAK_LIMIT + 1}))  # the machine is fixed
    base = baseline(resumed)
    assert base is not None and base.state == TrialState.COMPLETE and base.number > 0  # measured this time
    assert sum(t.state == TrialState.COMPLETE for t in resumed.trials) >= 2


def test_starts_that_fail_for_their_config_never_trip_it(tmp_path, config_only_model):
    starts = []
    config = make_config(tmp_path, config_only_model, budget=STREAK_LIMIT + 2)
    study = run_study(tmp_path, config, engine=broken_engine(CONFIG_LOG, starts))
    assert len(starts) == STREAK_LIMIT + 2
    assert all(t.state == TrialState.PRUNED and t.user_attrs["pruned_reason"] == failures.INVALID_CONFIG
               for t in study.trials)
