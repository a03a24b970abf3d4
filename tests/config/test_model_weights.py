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
