"""The one module that builds and reads vLLM's config for the preflight.

Two readings of what the installed vLLM makes of a trial's engine arguments, before anything loads:

- the `VllmConfig` it builds (`EngineArgs.create_engine_config`, the call its engine start makes first): its
  max_model_len, its batch defaults for this device and deployment, the tokens in flight, MLA under the trial's
  environment;
- one rank's model as vLLM builds it, on PyTorch's meta device (no weights, no memory): the KV cache spec each of its
  attention, sliding-window, MLA, Mamba or other layers asks for (each layer's own `get_kv_cache_spec`, as vLLM's model
  runner collects them), and the bytes of its parameters and buffers. It is built in a child process
  (`python -m optimizer.engines.vllm_config`), as rank 0 of the trial's tensor, pipeline and data parallel layout, so
  that nothing of it (a device context, vLLM's process groups) stays in this process.

The cache one sequence of max_model_len tokens needs is then counted over those specs as vLLM's engine core checks it
at start (`kv_bytes_one_sequence`). Nothing here derives a value vLLM already resolves.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optimizer.config.resolved import Resolved


@contextmanager
def trial_environment(env: Mapping[str, str]) -> Iterator[None]:
    """This process's environment with the trial's `env:` parameters set (vLLM reads VLLM_MLA_DISABLE and
    VLLM_USE_V2_MODEL_RUNNER while it builds its config), as it was afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        restore_environment(saved)


def restore_environment(saved: Mapping[str, str | None]) -> None:
    """Each variable of `saved` back to its value (None: unset), as it was before a trial's environment was set."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def model_defaults(engine_args: Mapping[str, Any], longer: int = 0) -> tuple[int, bool] | None:
    """(the longest max_model_len the installed vLLM runs the model with: its default, or `longer` where vLLM accepts
    that too (a LongRoPE model's full context beside the shorter one vLLM defaults to), whether it runs it with
    multi-head latent attention), from the `ModelConfig` it builds for the study's engine arguments (`model` among
    them); None where it cannot build one (its own start then says why)."""
    from vllm import EngineArgs

    args = {"skip_tokenizer_init": True, **engine_args}
    try:
        config = EngineArgs(**args).create_model_config()
    except Exception:  # noqa: BLE001 - vLLM raises what its validators raise; the trial's start reports it
        return None
    longest = int(config.max_model_len)
    if longer > longest and "max_model_len" not in engine_args:
        try:
            longest = int(EngineArgs(**args, max_model_len=longer).create_model_config().max_model_len)
        except Exception:  # noqa: BLE001 - vLLM refuses that length for this model: its default stays
            pass
    return longest, bool(config.use_mla)


# Engine arguments that do not change what a rank's model builds (its layers' KV cache specs, its parameters): trials
# that differ only in these share one build
SCHEDULING_ARGS = frozenset({
    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "gpu_memory_utilization", "kv_cache_memory_bytes",
    "enable_chunked_prefill", "async_scheduling", "enforce_eager", "compilation_config", "cuda_graph_sizes",
    "max_cudagraph_capture_size", "scheduling_policy", "long_prefill_token_threshold", "max_num_partial_prefills",
    "max_long_partial_prefills", "stream_interval", "performance_mode", "disable_log_stats"})
BUILD_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RankModel:
    """One rank's model as the installed vLLM builds it for a trial (on the meta device, in a child process)."""

    specs: dict[str, Any]  # layer name -> the KV cache spec it asks for (vllm.v1.kv_cache_interface)
    weights_bytes: int  # its parameters and buffers, as they load
    kv_cache_layout: str | None = None  # the layout vLLM's engine core resolves from its attention backends


def resolved(vllm_config: Any, rank: RankModel | None = None) -> Resolved:
    """The preflight's numbers, read from vLLM's config for the trial (under the trial's environment: vLLM reads
    some of it lazily, `ModelConfig.use_mla` among them) and from one rank's model as vLLM builds it (`rank_model`;
    None: not built, the cache and weights then unknown to it)."""
    model, scheduler, cache = vllm_config.model_config, vllm_config.scheduler_config, vllm_config.cache_config
    # -1 asks vLLM to fit the length to the memory at start: nothing for the preflight to check against
    length = -1 if getattr(model, "original_max_model_len", None) == -1 else int(model.max_model_len)
    one_sequence = kv_bytes_one_sequence(vllm_config, rank) if rank is not None and length > 0 else 0
    return Resolved(max_model_len=length, max_num_seqs=int(scheduler.max_num_seqs),
                    max_num_batched_tokens=int(scheduler.max_num_batched_tokens),
                    max_in_flight_tokens=int(vllm_config.max_in_flight_tokens), use_mla=bool(model.use_mla),
                    kv_cache_dtype=str(cache.cache_dtype), kv_bytes_one_sequence=one_sequence,
                    kv_bytes_per_token=one_sequence // length if one_sequence else 0,
                    weights_bytes=rank.weights_bytes if rank is not None else 0)


def kv_bytes_one_sequence(vllm_config: Any, rank: RankModel) -> int:
    """The KV cache one sequence of the config's max_model_len needs on a rank, as vLLM's engine core checks it at
    start (`kv_cache_utils.get_kv_cache_configs`): the layers grouped as its KV cache manager groups them (the groups
    of a hybrid model padded to one size), each group's blocks for one sequence, and the block its pool holds back;
    where this vLLM lacks those functions, `max_memory_usage_bytes` over the layers' specs (a little under, sliding
    windows promoted to full attention where the hybrid manager is off). 0 where vLLM cannot say."""
    from vllm.v1.core import kv_cache_utils

    specs = dict(rank.specs)
    grouped = getattr(kv_cache_utils, "_max_memory_usage_bytes_from_groups", None)
    held_back = getattr(kv_cache_utils, "_pool_bytes_per_block", None)
    try:
        if grouped is None or held_back is None or rank.kv_cache_layout is None:
            if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
                kv_cache_utils.unify_hybrid_kv_cache_specs(specs)
            return int(kv_cache_utils.max_memory_usage_bytes(vllm_config, specs.values()))
        vllm_config.cache_config.kv_cache_layout = rank.kv_cache_layout  # as the engine core records it
        groups = kv_cache_utils.get_kv_cache_groups(vllm_config, specs)
        return int(grouped(vllm_config, groups) + (held_back(vllm_config, groups) if groups else 0))
    except (ValueError, NotImplementedError, AssertionError, TypeError, AttributeError):
        return 0


def build_key(engine_args: Mapping[str, Any], deploy_as: str, env: Mapping[str, str]) -> str:
    """What one rank's model depends on: the engine arguments but the scheduler's, the deployment, the trial's
    environment."""
    kept = {k: v for k, v in engine_args.items() if k not in SCHEDULING_ARGS}
    return json.dumps([kept, deploy_as, dict(env)], sort_keys=True, default=str)


_BUILT: dict[str, RankModel | None] = {}  # by `build_key`: one build per model layout in a run


def rank_model(engine_args: Mapping[str, Any], deploy_as: str, env: Mapping[str, str],
               timeout_s: float = BUILD_TIMEOUT_S) -> RankModel | None:
    """One rank's model as the installed vLLM builds it for `engine_args` (on the meta device, in a child process
    with the trial's environment `env`; once per `build_key` in a run); None where the build fails or takes longer
    than `timeout_s` (the engine's own start then decides)."""
    engine_args = {"skip_tokenizer_init": True, **engine_args}
    key = build_key(engine_args, deploy_as, env)
    if key not in _BUILT:
        _BUILT[key] = _build_in_child(engine_args, deploy_as, env, timeout_s)
    return _BUILT[key]


def _build_in_child(engine_args: Mapping[str, Any], deploy_as: str, env: Mapping[str, str],
                    timeout_s: float) -> RankModel | None:
    with tempfile.TemporaryDirectory(prefix="optimizer-rank-") as tmp:
        request, out = Path(tmp) / "args.json", Path(tmp) / "rank.pkl"
        request.write_text(json.dumps({"engine_args": dict(engine_args), "deploy_as": deploy_as}, default=str))
        try:
            done = subprocess.run([sys.executable, "-m", "optimizer.engines.vllm_config", str(request), str(out)],
                                  env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return None
        if done.returncode != 0 or not out.is_file():
            return None
        with out.open("rb") as fh:
            return pickle.load(fh)


def build_rank_model(engine_args: Mapping[str, Any], deploy_as: str) -> RankModel:
    """In a child process only: rank 0 of the trial's layout as vLLM's model loader builds it, on the meta device.
    The process is a world of one whose tensor, pipeline, data and expert parallel groups say the layout's sizes, so
    that each layer takes a rank's share of heads, experts and layers as it would on the real GPUs."""
    import torch
    import torch.fx.experimental._config
    from vllm import AsyncEngineArgs
    from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    from optimizer.engines.server import free_port
    from optimizer.params.deploy import usage_context

    # what a layer reads from its tensors' values as it builds, for its log lines only: meta tensors have none
    torch.fx.experimental._config.meta_nonzero_assume_all_nonzero = True
    try:
        from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager

        ExpertMapManager.get_compressed_map_string = lambda self: "(not read: built on the meta device)"
    except ImportError:
        pass
    config = AsyncEngineArgs(**engine_args).create_engine_config(usage_context(deploy_as))
    parallel = config.parallel_config
    sizes = {"tensor_parallel_size": parallel.tensor_parallel_size,
             "pipeline_parallel_size": parallel.pipeline_parallel_size,
             "data_parallel_size": parallel.data_parallel_size}
    with set_current_vllm_config(config):
        for name in sizes:
            setattr(parallel, name, 1)  # the groups of a world of one, then told the layout's sizes
        try:
            parallel_state.init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}")
            parallel_state.initialize_model_parallel(1, 1)
        finally:
            for name, size in sizes.items():
                setattr(parallel, name, size)
        tp, pp, dp = sizes.values()
        for group, size in ((parallel_state._TP, tp), (parallel_state._PP, pp), (parallel_state._DP, dp),
                            (parallel_state._EP, tp * dp if parallel.enable_expert_parallel else 1)):
            if group is not None:
                group.world_size = size
        with set_default_torch_dtype(config.model_config.dtype), torch.device("meta"):  # as vLLM's loader does
            model = get_model_loader(config.load_config).create_model(config, config.model_config)
        specs = {name: layer.get_kv_cache_spec(config)
                 for name, layer in get_layers_from_vllm_config(config, AttentionLayerBase).items()}
        specs = {k: v for k, v in specs.items() if v is not None}
        layout = None
        try:  # the layout the engine core resolves from what its workers' attention backends support
            from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
            from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout

            supported = [m.name for m in get_supported_kv_cache_layouts(get_current_attn_backends(config))]
            layout = resolve_kv_cache_layout(config, [supported], specs.values()).name
        except (ImportError, ValueError, AssertionError, AttributeError, TypeError):
            pass
    tensors = [*model.parameters(), *model.buffers()]
    return RankModel(specs, sum(t.numel() * t.element_size() for t in tensors), layout)


def main(argv: list[str]) -> None:
    """The child's part: read the request, build the rank, write it where the parent reads it."""
    request = json.loads(Path(argv[0]).read_text())
    rank = build_rank_model(request["engine_args"], request["deploy_as"])
    with open(argv[1], "wb") as fh:
        pickle.dump(rank, fh)


if __name__ == "__main__":  # run as a module: the parent unpickles the class under its module's name
    from optimizer.engines import vllm_config

    vllm_config.main(sys.argv[1:])
