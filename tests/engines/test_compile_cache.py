"""GPU trials compile: vLLM's compile cache is kept per study, and an engine start's compile and CUDA-graph capture
are counted apart (parsed from vLLM's own log lines). The evidence that almost every trial compiles anew: vLLM's
config hash, which keys the compile cache, changes with max_num_seqs and max_num_batched_tokens."""

from pathlib import Path

import pytest

from optimizer.engines.compile_cache import CACHE_ENV, cache_env, cache_root, start_phases

# A GPU start's log as vLLM 0.32 writes it (format strings of vllm/v1/worker/gpu_model_runner.py,
# vllm/compilation/monitor.py and decorators.py, vllm/v1/engine/core.py)
GPU_START_LOG = """\
(EngineCore_DP0 pid=7) INFO 12-01 09:00:01 [gpu_model_runner.py:5150] Model loading took 14.99 GiB memory and 6.421337 seconds
(EngineCore_DP0 pid=7) INFO 12-01 09:00:20 [backends.py:1167] Dynamo bytecode transform time: 9.12 s
(EngineCore_DP0 pid=7) INFO 12-01 09:00:48 [monitor.py:62] torch.compile and initial profiling/warmup run together took 37.80 s in total
(EngineCore_DP0 pid=7) INFO 12-01 09:01:30 [gpu_model_runner.py:6582] Graph capturing finished in 41 secs, took 0.52 GiB
(EngineCore_DP0 pid=7) INFO 12-01 09:01:31 [core.py:396] init engine (profile, create kv cache, warmup model) took 90.04 s (compilation: 37.80 s)
"""


def test_start_phases_count_compile_and_capture_apart():
    assert start_phases(GPU_START_LOG) == {"model_load_s": 6.421337, "compile_s": 37.80, "cudagraph_capture_s": 41.0,
                                           "engine_init_s": 90.04}
    assert start_phases("(EngineCore pid=1) INFO init engine (profile, create kv cache, warmup model) took 3.10 s\n") \
        == {"engine_init_s": 3.10}  # eager (the CPU demo): nothing compiled, nothing captured


def test_gpu_trials_get_the_studys_own_compile_cache(tmp_path):
    logs = tmp_path / "llama8b.logs"
    assert cache_root(logs) == tmp_path / "llama8b.vllm_cache"
    assert cache_env(logs, "cuda", environ={}) == {f"env:{CACHE_ENV}": str((tmp_path / "llama8b.vllm_cache").resolve())}
    assert cache_env(logs, "cuda", environ={CACHE_ENV: "/mine"}) == {}  # the user's choice wins
    assert cache_env(logs, "cpu", environ={}) == {}  # eager CPU trials compile nothing


def test_vllm_reads_the_cache_root_it_is_given(tmp_path, monkeypatch):
    envs = pytest.importorskip("vllm.envs")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "s.vllm_cache"))
    assert Path(envs.VLLM_CACHE_ROOT) == tmp_path / "s.vllm_cache"  # where backends.py puts torch_compile_cache/


def test_the_compile_cache_key_changes_with_the_batch_knobs(tiny_model):
    """vLLM's VllmConfig.compute_hash, a factor of the compile cache's key: another max_num_seqs or
    max_num_batched_tokens is another cache entry, the same config the same one."""
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")

    def key(**kw):
        args = arg_utils.EngineArgs(model=str(tiny_model), skip_tokenizer_init=True, **kw)
        return args.create_engine_config().compute_hash()

    base = key(max_num_seqs=64, max_num_batched_tokens=2048)
    assert key(max_num_seqs=64, max_num_batched_tokens=2048) == base
    assert key(max_num_seqs=128, max_num_batched_tokens=2048) != base
    assert key(max_num_seqs=64, max_num_batched_tokens=4096) != base
