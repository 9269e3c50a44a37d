"""A model's memory layout from its headers: per-layer bytes, shared bytes, KV per token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.split.layout import INDEX_FILE, LayoutError, layout_of, read_layout, write_index
from worker.testing import make_tiny_gemma3_model, make_tiny_model


def test_tiny_llama_layout_adds_up(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", num_layers=4, sliding_window=3)
    layout = read_layout(model)
    file_bytes = (model / "model.safetensors").stat().st_size
    assert layout.num_layers == 4
    assert len(set(layout.layer_bytes)) == 1  # identical blocks
    # Everything but the header is a tensor, and each tensor is a layer's or shared.
    assert 0 < file_bytes - (sum(layout.layer_bytes) + layout.shared_bytes) < 4096
    # float32, 2 KV heads of 16: 2 * 2 * 16 * 4 bytes a token.
    assert layout.kv_bytes_per_token == (256,) * 4
    assert layout.window == (3, None, 3, None)
    assert layout.kv_bytes(0, 100) == 3 * 256 and layout.kv_bytes(1, 100) == 100 * 256
    assert layout.layer_files == (("model.safetensors",),) * 4


def test_gemma3_windows_follow_its_pattern(tmp_path: Path) -> None:
    layout = read_layout(make_tiny_gemma3_model(tmp_path / "g", num_layers=6, sliding_window=4))
    assert layout.window == (4, 4, None, 4, 4, None)
    assert layout.kv_bytes_per_token[0] == 2 * 2 * 16 * 4


def test_index_maps_every_tensor_to_its_file(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m")
    index = json.loads(write_index(model).read_text())
    assert (model / INDEX_FILE).is_file()
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert "model.layers.1.mlp.down_proj.weight" in index["weight_map"]
    layout = read_layout(model)
    assert index["metadata"]["total_size"] == sum(layout.layer_bytes) + layout.shared_bytes


def test_layer_weights_are_found_in_any_file_and_nesting() -> None:
    tensors = {
        "language_model.model.layers.0.mlp.weight": {"dtype": "BF16", "shape": [4, 8], "file": "a"},
        "language_model.model.layers.1.mlp.weight": {"dtype": "BF16", "shape": [4, 8], "file": "b"},
        "language_model.model.norm.weight": {"dtype": "BF16", "shape": [8]},
        "language_model.model.layers.7.mtp.weight": {"dtype": "BF16", "shape": [99]},
    }
    config = {"text_config": {"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2}}
    layout = layout_of(config, tensors)
    assert layout.layer_bytes == (64, 64) and layout.shared_bytes == 16
    assert layout.layer_files == (("a",), ("b",))
    assert layout.kv_bytes_per_token == (2 * 2 * 4 * 2,) * 2


@pytest.mark.parametrize(
    "config", [{}, {"num_hidden_layers": "x", "hidden_size": 8, "num_attention_heads": 2}]
)
def test_a_config_without_layers_is_a_layout_error(config: dict) -> None:
    with pytest.raises(LayoutError):
        layout_of(config, {})


def test_an_unreadable_directory_is_a_layout_error(tmp_path: Path) -> None:
    with pytest.raises(LayoutError):
        read_layout(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\x01")
    with pytest.raises(LayoutError):
        read_layout(tmp_path)
