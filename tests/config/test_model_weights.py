"""Weights are counted once, as vLLM loads them: a repository with consolidated.safetensors beside the sharded
model-*.safetensors is not counted twice (which would prune configs as out of memory that fit)."""

import json

import pytest

from optimizer.config.model import DEFAULT_MODEL_CONFIG, inspect_model, safetensors_weights_bytes
from optimizer.core.errors import UsageError

MIB = 1024**2


def _file(path, size):
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: the size is all that is read


@pytest.fixture
def sharded(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(DEFAULT_MODEL_CONFIG))
    _file(d / "model-00001-of-00002.safetensors", 30 * MIB)
    _file(d / "model-00002-of-00002.safetensors", 18 * MIB)
    (d / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": 48 * MIB},
        "weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors",
                       "c.weight": "model-00002-of-00002.safetensors"}}))
    return d


def test_sharded_files_are_counted_from_the_index(sharded):
    assert safetensors_weights_bytes(sharded) == 48 * MIB


def test_a_consolidated_file_beside_the_shards_is_counted_once(sharded):
    _file(sharded / "consolidated.safetensors", 48 * MIB)  # Mistral's repositories ship both forms
    assert safetensors_weights_bytes(sharded) == 48 * MIB  # vLLM (load_format auto) loads the consolidated form
    assert inspect_model(str(sharded)).weights_bytes == 48 * MIB  # not 96


def test_a_stray_file_outside_the_index_is_not_counted(sharded):
    _file(sharded / "adapter.safetensors", 5 * MIB)
    assert safetensors_weights_bytes(sharded) == 48 * MIB


def test_without_an_index_every_file_counts(tmp_path):
    _file(tmp_path / "model.safetensors", 7 * MIB)
    assert safetensors_weights_bytes(tmp_path) == 7 * MIB


def test_a_broken_index_names_the_file(sharded):
    (sharded / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(UsageError, match="model.safetensors.index.json is not a safetensors index"):
        inspect_model(str(sharded))


def test_multi_token_prediction_layers_are_not_counted(tmp_path):
    """DeepSeek V3's layer 61 (num_nextn_predict_layers past num_hidden_layers) is in its files, but vLLM's base model
    skips it (models/utils.py skip_spec_layers): ~11.5 GB of 688, 1.4 GiB a GPU at TP=8 that would otherwise count
    against the KV cache. The tensors' sizes come from the files' own safetensors headers."""
    import numpy as np
    from safetensors.numpy import save_file

    from optimizer.config.model import model_info

    config = {**DEFAULT_MODEL_CONFIG, "model_type": "deepseek_v3", "num_hidden_layers": 2,
              "num_nextn_predict_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    layer = np.zeros(MIB // 2, dtype=np.float16)  # 1 MiB
    save_file({"model.layers.0.w": layer, "model.layers.1.w": layer, "model.embed_tokens.weight": layer},
              str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"model.layers.2.w": layer, "model.layers.2.eh_proj.weight": layer},  # the MTP layer
              str(tmp_path / "model-00002-of-00002.safetensors"))
    on_disk = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert safetensors_weights_bytes(tmp_path, config) == on_disk - 2 * MIB
    assert safetensors_weights_bytes(tmp_path, {**config, "num_nextn_predict_layers": 0}) == on_disk
    assert inspect_model(str(tmp_path)).weights_bytes == model_info(config, "m", on_disk - 2 * MIB).weights_bytes


def test_qwen3_5_and_mimo_prediction_layers_are_not_counted(tmp_path):
    """Qwen3.5 keeps its MTP layers under `mtp.` (text config `qwen3_5_text`, `mtp_num_hidden_layers`), MiMo under
    `model.mtp_layers.`: vLLM's base models drop both (qwen3_5.py, mimo.py), so they are not
    weights (~1.6 GiB for Qwen3.5-35B-A3B)."""
    import numpy as np
    from safetensors.numpy import save_file

    layer = np.zeros(MIB // 2, dtype=np.float16)  # 1 MiB
    save_file({"model.layers.0.w": layer, "mtp.layers.0.w": layer, "model.mtp_layers.0.w": layer},
              str(tmp_path / "model.safetensors"))
    on_disk = (tmp_path / "model.safetensors").stat().st_size
    qwen35 = {"model_type": "qwen3_5_text", "num_hidden_layers": 1, "mtp_num_hidden_layers": 1}
    assert safetensors_weights_bytes(tmp_path, qwen35) == on_disk - 2 * MIB
    assert safetensors_weights_bytes(tmp_path, {"model_type": "mimo", "num_hidden_layers": 1}) == on_disk - 2 * MIB
    assert safetensors_weights_bytes(tmp_path, {"model_type": "llama", "num_hidden_layers": 1}) == on_disk
