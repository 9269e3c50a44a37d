"""Read a GGUF file: its metadata as plain Python values and its tensors as raw blocks.

A small parser of the GGUF v2/v3 layout over a memory map (nothing is copied until a tensor is
converted). ``gguf.GGUFReader`` reads the same files but builds a numpy view per array element,
which takes ~25 s for a 262k-token vocabulary; this takes well under a second. Every way a
broken file can fail becomes one :class:`CorruptGGUFError`.

Layout (little-endian): ``b"GGUF"``, version u32, tensor count u64, metadata count u64,
metadata ``key: string, type: u32, value``, tensor infos ``name, n_dims u32, dims u64 × n,
type u32, offset u64``, padding to ``general.alignment`` (32), then the tensor data.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from worker.convert.errors import CorruptGGUFError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# GGUF metadata value type -> struct format (scalars) and numpy dtype (arrays).
_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i",
    6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
# Plain tensor types stored as numpy arrays of their own dtype; the rest stay raw bytes.
_TENSOR_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
}
_MAX_COUNT = 1 << 24  # far beyond any real file; stops garbage counts from looping forever


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as stored: ``shape`` in numpy order (rows first), ``data`` the raw array
    (float dtypes as such; quantized and bf16 as uint8 with the last axis in bytes)."""

    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise CorruptGGUFError(f"{self.path}: truncated file (header ends early)")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def count(self) -> int:
        n = self.unpack("<Q")
        if n > _MAX_COUNT:
            raise CorruptGGUFError(f"{self.path}: implausible count {n} in the header")
        return n

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise CorruptGGUFError(f"{self.path}: truncated file (string runs past the end)")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # Some vocabularies hold invalid UTF-8 pieces; keep them rather than fail.
            return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        if vtype not in _SCALARS:
            raise CorruptGGUFError(f"{self.path}: unknown metadata value type {vtype}")
        return self.unpack(_SCALARS[vtype])

    def array(self) -> list[Any]:
        etype, n = self.unpack("<I"), self.count()
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype])
            if self.pos + n * dtype.itemsize > len(self.buf):
                raise CorruptGGUFError(f"{self.path}: truncated file (array runs past the end)")
            values = np.frombuffer(self.buf, dtype, n, self.pos).tolist()
            self.pos += n * dtype.itemsize
            return values
        return [self.value(etype) for _ in range(n)]


class GGUFFile:
    """An opened, validated GGUF file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as fh:
                if fh.read(4) != GGUF_MAGIC:
                    raise CorruptGGUFError(f"{path} is not a GGUF file (no GGUF magic)")
                buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise CorruptGGUFError(f"cannot read {path}: {exc.strerror or exc}") from exc
        cur = _Cursor(buf, path)
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise CorruptGGUFError(f"{path}: unsupported GGUF version {version}")
        n_tensors, n_kv = cur.count(), cur.count()
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            if n_dims > 8:
                raise CorruptGGUFError(f"{path}: tensor {name!r} has {n_dims} dimensions")
            dims = [cur.unpack("<Q") for _ in range(n_dims)]
            infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)) or 1
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, type_id, offset in infos:
            self.tensors[name] = _tensor(path, buf, name, dims, type_id, data_start + offset)

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


def _tensor(
    path: Path, buf: mmap.mmap, name: str, dims: list[int], type_id: int, start: int
) -> GGUFTensor:
    try:
        qtype = GGMLQuantizationType(type_id)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError) as exc:
        raise CorruptGGUFError(f"{path}: tensor {name!r} has unknown type {type_id}") from exc
    shape = tuple(reversed(dims))  # GGUF lists the fastest-moving dimension first
    n_elements = math.prod(shape)  # Python ints: a corrupt dimension cannot overflow
    if not shape or shape[-1] % block_size:
        raise CorruptGGUFError(f"{path}: tensor {name!r} has a partial block")
    nbytes = n_elements // block_size * type_size
    if start + nbytes > len(buf):
        raise CorruptGGUFError(
            f"{path}: tensor {name!r} runs past the end of the file (truncated download?)"
        )
    if qtype in _TENSOR_DTYPES:
        dtype = np.dtype(_TENSOR_DTYPES[qtype]).newbyteorder("<")
        data = np.frombuffer(buf, dtype, n_elements, start).reshape(shape)
    else:
        row_bytes = shape[-1] // block_size * type_size
        data = np.frombuffer(buf, np.uint8, nbytes, start).reshape(*shape[:-1], row_bytes)
    return GGUFTensor(name, qtype, shape, data)
