"""Rejected verify positions left in a batch cache as masked holes, instead of rolled out.

A verify pass feeds every row the same width; a row that drafted less (or nothing) rejects more
of it than the others. Rolling each such row's rejected tail into its left padding
(the roll in ``trim_rows``) moves the row's whole history in every layer: on this CPU box 170-190 ms for 4
rows over 1,300 positions of SmolLM2, more than a plain decode step, so a pass where one row of
four copies its prompt cost two steps and speculation declined (bench/results/speculative.md).
Here a row's rejected positions stay where they are and the attention mask hides them; each
row's ``offset`` (its rotary position) counts its real tokens only, so the model sees exactly
the context a roll would have left it. The holes live in the buffer's coordinates and follow it
through the batch's ``filter`` and ``extend``; a row's cache taken out (a finished or forked
row, for the prompt cache) is gathered without them.

Plain ``BatchKVCache`` layers only: sliding windows and a split group's recorded caches (whose
followers replay the cache calls) keep the roll.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache

from worker.mlx_lm_hooks import write_index


def can_punch(caches: list[Any]) -> bool:
    return bool(caches) and all(type(c) is BatchKVCache for c in caches)


class Holes:
    """Which buffer positions of each row are real tokens; None while there are no holes."""

    def __init__(self) -> None:
        self.valid: np.ndarray | None = None  # (rows, positions) bool; beyond it: all real
        self._visible: tuple[int, mx.array] | None = None  # the last mask row, by length

    def punch(self, caches: list[Any], extra: list[int]) -> None:
        """Row i's last ``extra[i]`` positions before the write index (after the pass's common
        trim) become holes: the next tokens are written after them. Earlier holes past the
        write index are gone (those positions will be written again)."""
        if any(extra):
            shift = mx.array(extra)
            for cache in caches:
                cache.offset = cache.offset - shift
        elif self.valid is None:
            return
        end = write_index(caches[0])
        valid = self._sized(len(extra), end)
        for row, n in enumerate(extra):
            valid[row, end - n : end] = False
        self._set(caches, valid)

    def filter(self, caches: list[Any], keep: list[int]) -> None:
        """Follow ``BatchKVCache.filter`` (called before it): rows kept, and the left padding
        all kept rows share cut off."""
        if self.valid is None:
            return
        if not keep:
            self._set(caches, None)
            return
        padding = caches[0].left_padding.tolist()
        shift = min(padding[i] for i in keep)
        self._set(caches, self.valid[keep, shift:])

    def extend(
        self, caches: list[Any], before: int, other: Holes | None, other_before: int
    ) -> None:
        """Follow ``BatchKVCache.extend``: both batches right-justified to the longer write
        index (``before`` and ``other_before``: each batch's before it)."""
        theirs = other.valid if other is not None else None
        if self.valid is None and theirs is None:
            return
        end = write_index(caches[0])
        total = caches[0].offset.shape[0]
        rows = len(self.valid) if self.valid is not None else total - len(theirs)  # type: ignore[arg-type]
        valid = np.ones((total, end), bool)
        valid[:rows, end - before :] = self._sized(rows, before)
        if theirs is not None:
            valid[rows:, end - other_before :] = _fit(theirs, other_before)
        self._set(caches, valid)

    def extract(self, caches: list[Any], row: int) -> list[Any] | None:
        """Row ``row``'s caches as a prefill of its real tokens would leave them, or None when
        the row has no holes (``BatchKVCache.extract`` does)."""
        if self.valid is None or self.valid[row].all():
            return None
        end = write_index(caches[0])
        padding = int(caches[0].left_padding[row].item())
        real = _fit(self.valid[row : row + 1], end)[0]
        real[:padding] = False
        where = mx.array(np.flatnonzero(real))
        out = []
        for cache in caches:
            single = KVCache()
            single.keys = mx.contiguous(mx.take(cache.keys[row : row + 1], where, axis=2))
            single.values = mx.contiguous(mx.take(cache.values[row : row + 1], where, axis=2))
            single.offset = single.keys.shape[2]
            out.append(single)
        return out

    def _sized(self, rows: int, end: int) -> np.ndarray:
        if self.valid is None:
            return np.ones((rows, end), bool)
        return _fit(self.valid, end)

    def _set(self, caches: list[Any], valid: np.ndarray | None) -> None:
        self.valid = None if valid is None or valid.all() else valid
        self._visible = None
        for cache in caches:
            if self.valid is None:
                cache.__dict__.pop("make_mask", None)
            else:
                cache.make_mask = partial(_masked, cache, self)

    def visible(self, length: int) -> mx.array:
        """(rows, 1, 1, length): which keys a query may see for the holes."""
        if self._visible is None or self._visible[0] != length:
            assert self.valid is not None
            row = _fit(self.valid, length)
            self._visible = (length, mx.array(row)[:, None, None, :])
        return self._visible[1]


def _fit(valid: np.ndarray, length: int) -> np.ndarray:
    """``valid`` cut or padded with real positions to ``length`` columns (a copy)."""
    if valid.shape[1] >= length:
        return valid[:, :length].copy()
    pad = np.ones((valid.shape[0], length - valid.shape[1]), bool)
    return np.concatenate([valid, pad], axis=1)


def _masked(
    cache: BatchKVCache, holes: Holes, N: int, return_array: bool = False, **kwargs: Any
) -> mx.array:
    """``BatchKVCache.make_mask`` with the holes hidden."""
    mask = create_causal_mask(
        N, offset=write_index(cache), left_padding=cache.left_padding, **kwargs
    )
    return mask & holes.visible(write_index(cache) + N)
