"""Read a GGUF file: its metadata as plain Python values and its tensors as raw blocks.

A thin layer over ``gguf.GGUFReader`` (memory-mapped, nothing is copied until asked) that turns
every way a broken file can fail into one :class:`CorruptGGUFError`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from worker.convert.errors import CorruptGGUFError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as stored: ``shape`` in numpy order (rows first), ``data`` the raw array."""

    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


class GGUFFile:
    """An opened, validated GGUF file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as fh:
                magic = fh.read(4)
        except OSError as exc:
            raise CorruptGGUFError(f"cannot read {path}: {exc.strerror or exc}") from exc
        if magic != GGUF_MAGIC:
            raise CorruptGGUFError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
        try:
            reader = GGUFReader(path)
        except (ValueError, OSError, IndexError, KeyError, struct.error, TypeError) as exc:
            raise CorruptGGUFError(f"{path} is not a readable GGUF file: {exc}") from exc
        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            try:
                self.metadata[key] = field.contents()
            except (ValueError, IndexError, UnicodeDecodeError) as exc:
                raise CorruptGGUFError(f"{path}: unreadable metadata field {key!r}: {exc}") from exc
        self.tensors: dict[str, GGUFTensor] = {}
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            tensor = GGUFTensor(t.name, GGMLQuantizationType(t.tensor_type), shape, t.data)
            _check_size(path, tensor)
            self.tensors[t.name] = tensor

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        """A metadata value the conversion cannot do without."""
        if key not in self.metadata:
            raise CorruptGGUFError(f"{self.path}: missing metadata key {key!r}")
        return self.metadata[key]

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))


def _check_size(path: Path, tensor: GGUFTensor) -> None:
    """A truncated file yields short memory maps rather than errors: compare byte counts."""
    block_size, type_size = GGML_QUANT_SIZES[tensor.type]
    if tensor.n_elements % block_size:
        raise CorruptGGUFError(f"{path}: tensor {tensor.name} has a partial block")
    expected = tensor.n_elements // block_size * type_size
    if tensor.data.nbytes != expected:
        raise CorruptGGUFError(
            f"{path}: tensor {tensor.name} has {tensor.data.nbytes} bytes, expected {expected}"
            " (truncated file?)"
        )
