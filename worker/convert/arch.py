"""What each supported architecture contributes to a conversion: config, names, fix-ups."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from worker.convert.errors import UnsupportedModelError
from worker.convert.gguf_file import GGUFFile
from worker.convert.quant import Converted

_BLOCK = re.compile(r"blk\.(\d+)\.(.+)\.(weight|bias)$")


@dataclass(frozen=True)
class Architecture:
    """One GGUF ``general.architecture`` and how it becomes an mlx-lm model directory."""

    gguf_name: str
    # Norms and unquantized weights are stored in this dtype; so are quantization scales.
    dtype: mx.Dtype
    make_config: Callable[[GGUFFile], dict[str, Any]]
    # GGUF tensor name -> mlx-lm parameter name; None drops the tensor.
    tensor_name: Callable[[str], str | None]
    # Fix-ups that undo llama.cpp's storage conventions (mlx name, value, config) -> value.
    transform: Callable[[str, Converted, dict[str, Any]], Converted]


def map_tensor_name(
    name: str, top: Mapping[str, str], block: Mapping[str, str], skip: frozenset[str]
) -> str | None:
    """Map ``blk.N.<part>.weight`` and top-level names through the architecture's tables.

    Returns None for tensors in ``skip``; a name in neither table is an error, since silently
    dropping weights would give a model that loads and talks nonsense.
    """
    if name in skip:
        return None
    if name in top:
        return top[name]
    match = _BLOCK.match(name)
    if match and match.group(2) in block:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{block[part]}.{kind}"
    raise UnsupportedModelError(f"unknown tensor {name!r} for this architecture")


def meta(gguf: GGUFFile, arch: str, key: str, default: Any = None) -> Any:
    """``<arch>.<key>`` from the metadata, required when no default is given."""
    full = f"{arch}.{key}"
    if default is None:
        return gguf.require(full)
    return gguf.get(full, default)


def transformer_dims(gguf: GGUFFile, arch: str) -> dict[str, Any]:
    """The config keys every decoder-only GGUF architecture states the same way."""
    n_heads = int(meta(gguf, arch, "attention.head_count"))
    hidden = int(meta(gguf, arch, "embedding_length"))
    return {
        "hidden_size": hidden,
        "intermediate_size": int(meta(gguf, arch, "feed_forward_length")),
        "num_hidden_layers": int(meta(gguf, arch, "block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta(gguf, arch, "attention.head_count_kv", n_heads)),
        "head_dim": int(meta(gguf, arch, "attention.key_length", hidden // n_heads)),
    }


def f32(value: Any) -> float:
    """A float32 metadata value as the float it was written as (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))
