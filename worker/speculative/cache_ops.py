"""The batch cache operations a speculative verify pass needs (worker/speculative/batch.py): whether
every layer can hand a rejected tail back, sliding windows put in order before a pass of several
tokens, and each row's rejected positions dropped.

Only the batch caches' own operations (``trim``, ``prepare(right_padding)`` + ``finalize``), so
a split group's followers replay them (worker/split/cache.py) like any other batch step.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

from worker.mlx_lm_hooks import put_window_in_order, set_window_lengths, write_index
from worker.speculative.holes import Holes, can_punch


def trim_rows(caches: list[Any], rejected: list[int], holes: Holes | None = None) -> None:
    """Drop each row's last ``rejected[i]`` positions from every layer's cache: what all rows
    rejected is trimmed; what a row rejected beyond that becomes ``holes`` where the layers
    allow (worker/speculative/holes.py), else it rolls into the row's left padding (as mlx-lm pads
    a prefill)."""
    common = min(rejected)
    extra = [r - common for r in rejected]
    if holes is not None and can_punch(caches):
        for cache in caches:
            cache.trim(common)
        holes.punch(caches, extra)
        return
    for cache in caches:
        if type(cache) is BatchRotatingKVCache:
            trim_window(cache, common, extra)
            continue
        if common:
            cache.trim(common)
        if any(extra):
            cache.prepare(right_padding=extra)
            cache.finalize()


def can_trim(caches: list[Any]) -> bool:
    """Whether a verify pass can hand every layer's rejected tail back: plain batch caches,
    with sliding windows among them outside a split group (a split rank 0 records its first
    layer's calls, which its followers replay on every layer: they would not cut a window)."""
    if caches and is_recording(caches[0]):
        return all(type(c) is BatchKVCache or is_recording(c) for c in caches)
    return all(type(c) in (BatchKVCache, BatchRotatingKVCache) for c in caches)


def in_order(caches: list[Any]) -> None:
    """Put rotated sliding windows back in temporal order before a pass of several tokens. The
    model builds its mask before the layers update their caches, from the write index; a
    rotated window's update of several tokens first reorders itself (moving that index), so
    its mask would be one column off and a row shorter than the window would lose its oldest
    token. Plain decoding never feeds a rotated window several tokens; a verify pass does."""
    for cache in caches:
        if type(cache) is BatchRotatingKVCache and cache.keys is not None:
            put_window_in_order(cache)


def trim_window(cache: BatchRotatingKVCache, common: int, extra: list[int]) -> None:
    """Drop rejected positions from a sliding-window layer, leaving it as a prefill of the
    accepted tokens would have (so mlx-lm's own window, rotation and mask logic go on as
    after any prefill). A verify pass of two or more tokens went through the window's
    concatenating update, so its keys are in temporal order and the rejected tail is at the
    end: ``trim`` moves the write index back and the tail is cut off (left there, a later
    rotation would keep it as context); a row that rejected more rolls its extra tail into
    its left padding, as mlx-lm does for a right-padded prefill (``finalize``)."""
    if common:
        cache.trim(common)
        cache.keys = cache.keys[..., : write_index(cache), :]
        cache.values = cache.values[..., : write_index(cache), :]
    if any(extra):
        set_window_lengths(cache, cache.offset - mx.array(extra))
        cache.finalize()


def is_recording(cache: Any) -> bool:
    """A split rank 0's batch cache: ``BatchKVCache`` with its calls recorded."""
    return type(cache).__name__ == "RecordingBatchKVCache" and isinstance(cache, BatchKVCache)
