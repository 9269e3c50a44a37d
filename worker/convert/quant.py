"""GGML tensor types → MLX arrays, keeping quantized weights quantized.

Q4_0, Q4_1 and Q8_0 are affine 4/8-bit formats with 32-element groups, exactly what MLX's
``mx.quantize`` produces: their blocks are repacked bit for bit (no precision lost). Every other
quantized type (K-quants, Q5_x, IQ…) is dequantized with the ``gguf`` package and requantized with
``mx.quantize`` at the nearest MLX bit width. Float tensors stay float.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from worker.convert.errors import CorruptGGUFError, UnsupportedModelError
from worker.convert.gguf_file import GGUFTensor

GROUP_SIZE = 32
FLOAT_TYPES = {QT.F32, QT.F16, QT.BF16, QT.F64}
MLX_BITS = (2, 3, 4, 5, 6, 8)


@dataclass
class QuantizedTensor:
    """An MLX affine-quantized matrix: ``w ≈ scales * q + biases`` per group of inputs."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int = GROUP_SIZE

    def take_rows(self, order: np.ndarray) -> QuantizedTensor:
        """Reorder output rows; exact, since groups run along the input dimension."""
        idx = mx.array(order)
        return QuantizedTensor(
            self.weight[idx], self.scales[idx], self.biases[idx], self.bits, self.group_size
        )

    def dequantize(self) -> mx.array:
        return mx.dequantize(
            self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits
        )


Converted = mx.array | QuantizedTensor


def target_bits(qtype: QT) -> int:
    """The MLX bit width that best keeps a GGML quantization type's precision."""
    match = re.match(r"I?Q(\d)", qtype.name)
    if match is None:
        raise UnsupportedModelError(f"tensor type {qtype.name} is not supported")
    bits = int(match.group(1))
    return min(b for b in MLX_BITS if b >= bits)


def to_float(tensor: GGUFTensor) -> np.ndarray:
    """Any tensor as finite float32 values in numpy order."""
    if tensor.type in (QT.F32, QT.F16, QT.F64):
        values = np.asarray(tensor.data, dtype=np.float32)
    else:
        try:
            with np.errstate(all="ignore"):  # non-finite results are rejected just below
                values = np.asarray(dequantize(tensor.data, tensor.type), dtype=np.float32)
        except NotImplementedError as exc:
            raise UnsupportedModelError(f"tensor type {tensor.type.name} is not supported") from exc
    _check_finite(values, tensor)
    return values.reshape(tensor.shape)


def convert_tensor(tensor: GGUFTensor, dtype: mx.Dtype, quantizable: bool) -> Converted:
    """Convert one tensor: quantized stays quantized where the layer can be (``quantizable``)."""
    is_matrix = len(tensor.shape) == 2 and tensor.shape[-1] % GROUP_SIZE == 0
    if tensor.type in FLOAT_TYPES or not (quantizable and is_matrix):
        return mx.array(to_float(tensor)).astype(dtype)
    repack = _REPACKERS.get(tensor.type)
    if repack is not None:
        q = repack(tensor)
        return QuantizedTensor(q.weight, q.scales.astype(dtype), q.biases.astype(dtype), q.bits)
    weight, scales, biases = mx.quantize(
        mx.array(to_float(tensor)).astype(dtype),
        group_size=GROUP_SIZE,
        bits=target_bits(tensor.type),
    )
    return QuantizedTensor(weight, scales, biases, target_bits(tensor.type))


def _blocks(tensor: GGUFTensor, block_bytes: int) -> np.ndarray:
    rows, cols = tensor.shape
    return np.ascontiguousarray(tensor.data).reshape(rows, cols // GROUP_SIZE, block_bytes)


def _f16(raw: np.ndarray, tensor: GGUFTensor) -> np.ndarray:
    """A block field of f16 scales/minimums, which must be finite."""
    values = np.ascontiguousarray(raw).view(np.float16)[..., 0]
    _check_finite(values, tensor)
    return values


def _check_finite(values: np.ndarray, tensor: GGUFTensor) -> None:
    # A real model never holds inf/NaN; they mean the data is misplaced or damaged, and would
    # only show up later as a model that outputs garbage.
    if not np.isfinite(values).all():
        raise CorruptGGUFError(f"tensor {tensor.name} holds non-finite values")


def _pack(q: np.ndarray, bits: int, rows: int) -> mx.array:
    """Pack unsigned ``bits``-bit values (rows, cols) into MLX's uint32 words, lowest bits first."""
    q = q.reshape(rows, -1).astype(np.uint8)
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    return mx.array(np.ascontiguousarray(q).view(np.uint32))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # A block's 16 bytes hold elements j (low nibble) and j + 16 (high nibble).
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _repack_q4_0(tensor: GGUFTensor) -> QuantizedTensor:
    blocks = _blocks(tensor, 18)
    d = _f16(blocks[..., 0:2], tensor).astype(np.float32)
    q = _pack(_nibbles(blocks[..., 2:18]), 4, tensor.shape[0])
    return QuantizedTensor(
        q, mx.array(d).astype(mx.float16), mx.array(-8 * d).astype(mx.float16), 4
    )


def _repack_q4_1(tensor: GGUFTensor) -> QuantizedTensor:
    blocks = _blocks(tensor, 20)
    d, m = _f16(blocks[..., 0:2], tensor), _f16(blocks[..., 2:4], tensor)
    q = _pack(_nibbles(blocks[..., 4:20]), 4, tensor.shape[0])
    return QuantizedTensor(q, mx.array(d), mx.array(m), 4)


def _repack_q8_0(tensor: GGUFTensor) -> QuantizedTensor:
    blocks = _blocks(tensor, 34)
    d = _f16(blocks[..., 0:2], tensor).astype(np.float32)
    signed = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8).astype(np.int16)
    q = _pack(signed + 128, 8, tensor.shape[0])
    return QuantizedTensor(
        q, mx.array(d).astype(mx.float16), mx.array(-128 * d).astype(mx.float16), 8
    )


_REPACKERS = {QT.Q4_0: _repack_q4_0, QT.Q4_1: _repack_q4_1, QT.Q8_0: _repack_q8_0}
