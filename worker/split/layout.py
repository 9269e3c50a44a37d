"""A model's memory layout, read from its ``config.json`` and safetensors headers (no weights).

What a split planner needs to place layers on nodes: the bytes of each transformer layer's
weights, the bytes every rank holds anyway (embeddings, final norm, output head), and the KV
cache bytes one token costs in each layer (sliding-window layers stop growing at their window).

``layout_of(config, tensors)`` is pure (config dict + header dicts in, a :class:`ModelLayout`
out); ``read_layout(path)`` is its thin file adapter.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INDEX_FILE = "model.safetensors.index.json"
# Matches mlx-lm's own rule (``sharded_load``): a weight belongs to layer N if its name has a
# ``layers.N.`` segment; everything else (embeddings, norm, head) is needed by every stage.
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I8": 1}


class LayoutError(Exception):
    """A model directory whose config or headers do not describe a layered decoder."""


@dataclass(frozen=True)
class ModelLayout:
    """Bytes per layer, shared bytes and KV cost of a decoder model, as stored.

    ``layer_files[i]`` names the safetensors files that hold layer ``i`` (so a node can fetch only
    its slice's shards); ``shared_files`` those holding the rest.
    """

    num_layers: int
    layer_bytes: tuple[int, ...]
    shared_bytes: int
    kv_bytes_per_token: tuple[int, ...]
    window: tuple[int | None, ...]  # a sliding layer's window (its KV stops growing there)
    context_length: int | None
    layer_files: tuple[tuple[str, ...], ...]
    shared_files: tuple[str, ...]

    def kv_bytes(self, layer: int, context: int) -> int:
        """KV cache bytes of ``layer`` holding ``context`` tokens."""
        window = self.window[layer]
        tokens = context if window is None else min(context, window)
        return self.kv_bytes_per_token[layer] * tokens


def layout_of(config: dict[str, Any], tensors: dict[str, dict[str, Any]]) -> ModelLayout:
    """The layout of a model from its config and its tensors' header entries (name →
    ``{"dtype", "shape", "data_offsets"}``, plus an optional ``"file"``)."""
    text = {**config, **(config.get("text_config") or {})}
    try:
        num_layers = int(text["num_hidden_layers"])
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
    except (KeyError, TypeError, ValueError) as exc:
        raise LayoutError(f"config.json does not describe a layered decoder ({exc})") from exc
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or hidden // heads)
    layer_bytes = [0] * num_layers
    layer_files: list[set[str]] = [set() for _ in range(num_layers)]
    shared, shared_files = 0, set()
    for name, info in tensors.items():
        size = _tensor_bytes(info)
        file = str(info.get("file", "model.safetensors"))
        match = _LAYER.search(name)
        if match is None:
            shared += size
            shared_files.add(file)
            continue
        layer = int(match.group(1))
        if layer >= num_layers:  # e.g. multi-token-prediction layers that mlx-lm drops
            continue
        layer_bytes[layer] += size
        layer_files[layer].add(file)
    if not any(layer_bytes):
        raise LayoutError("the safetensors headers name no per-layer weights")
    # The KV cache holds activations, whose dtype follows the unquantized weights (norms).
    element = _activation_bytes(tensors)
    per_token = 2 * kv_heads * head_dim * element
    return ModelLayout(
        num_layers=num_layers,
        layer_bytes=tuple(layer_bytes),
        shared_bytes=shared,
        kv_bytes_per_token=(per_token,) * num_layers,
        window=_windows(text, num_layers),
        context_length=_int_or_none(text.get("max_position_embeddings")),
        layer_files=tuple(tuple(sorted(f)) for f in layer_files),
        shared_files=tuple(sorted(shared_files)),
    )


def read_layout(path: str | Path) -> ModelLayout:
    """The layout of the MLX model directory at ``path`` (reads only JSON and headers)."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LayoutError(f"{path} has no readable config.json") from exc
    tensors: dict[str, dict[str, Any]] = {}
    for file in sorted(path.glob("*.safetensors")):
        for name, info in _header(file).items():
            if name != "__metadata__":
                tensors[name] = {**info, "file": file.name}
    return layout_of(config, tensors)


def write_index(path: str | Path) -> Path:
    """Write ``model.safetensors.index.json`` (the weight map mlx-lm's ``sharded_load`` reads:
    tensor name → file) for the safetensors files in ``path``; returns its path."""
    path = Path(path)
    weight_map: dict[str, str] = {}
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        for name, info in _header(file).items():
            if name != "__metadata__":
                weight_map[name] = file.name
                total += _tensor_bytes(info)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    out = path / INDEX_FILE
    out.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return out


def _windows(text: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    window = _int_or_none(text.get("sliding_window"))
    if window is None:
        return (None,) * num_layers
    types = text.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers:
        return tuple(window if t == "sliding_attention" else None for t in types)
    pattern = _int_or_none(text.get("sliding_window_pattern"))
    if pattern:  # gemma3: every pattern-th layer is global, the others slide
        return tuple(None if (i + 1) % pattern == 0 else window for i in range(num_layers))
    return (None,) * num_layers  # a window without a pattern: count it global (the upper bound)


def _activation_bytes(tensors: dict[str, dict[str, Any]]) -> int:
    for name, info in tensors.items():
        if "norm" in name and name.endswith("weight"):
            return _DTYPE_BYTES.get(str(info.get("dtype")), 2)
    return 2


def _tensor_bytes(info: dict[str, Any]) -> int:
    offsets = info.get("data_offsets")
    if isinstance(offsets, list) and len(offsets) == 2:
        return int(offsets[1]) - int(offsets[0])
    elements = 1
    for dim in info.get("shape", []):
        elements *= int(dim)
    return elements * _DTYPE_BYTES.get(str(info.get("dtype")), 2)


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _header(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise LayoutError(f"{path.name} is not a readable safetensors file") from exc
    if not isinstance(header, dict):
        raise LayoutError(f"{path.name} has a malformed safetensors header")
    return header
