"""A follower's side of the split caches: rank 0's steps and batch operations, replayed.

Rank 0's :class:`~worker.split.cache.CacheLedger` says what happened to its caches; each follower
makes the same calls, in the same order, on its own layers' caches (worker/split/cache.py tells
why that keeps them equal).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from worker.mlx_lm_hooks import original_merge_caches
from worker.split.cache import (
    COPY,
    EXTEND,
    EXTRACT,
    FILTER,
    FINALIZE,
    KEEP,
    MERGE,
    NEW,
    PREPARE,
    TRIM,
    SplitCacheError,
    Step,
    batch_columns,
    batch_rows,
)


class FollowerCaches:
    """A follower's caches and batches by id, changed only as rank 0's steps say."""

    def __init__(self, make: Callable[[], list[Any]]) -> None:
        self._make = make
        self._caches: dict[int, list[Any]] = {}
        self._batches: dict[int, list[Any]] = {}

    def __len__(self) -> int:
        return len(self._caches) + len(self._batches)

    def prepare_batch(self, step: Step) -> list[Any]:
        """Replay ``step``'s batch operations, apply its drops; the batch it runs on."""
        self._replay(step.ops)
        self._drop(step.drops)
        batch = self._batch(step.cache)
        shape = (batch_rows(batch[0]), batch_columns(batch[0])) if batch else (0, 0)
        if shape != (step.source, step.offset):
            raise SplitCacheError(
                f"batch {step.cache} is {shape[0]}x{shape[1]} here, "
                f"{step.source}x{step.offset} on rank 0"
            )
        return batch

    def _drop(self, ids: tuple[int, ...]) -> None:
        for cache_id in ids:
            self._caches.pop(cache_id, None)
            self._batches.pop(cache_id, None)

    def _replay(self, ops: tuple[int, ...]) -> None:
        i = 0
        while i < len(ops):
            i = self._apply(ops, i)

    def _apply(self, ops: tuple[int, ...], i: int) -> int:
        """Apply the operation at ``ops[i]`` (its kind, its batch id, its arguments); the index
        of the next one."""
        apply = _REPLAY.get(ops[i])
        if apply is None:
            raise SplitCacheError(f"unknown batch operation {ops[i]}: out of step with rank 0")
        return apply(self, ops[i + 1], ops, i + 2)

    def _merge(self, batch_id: int, ops: tuple[int, ...], at: int) -> int:
        rows = ops[at]
        pairs = ops[at + 1 : at + 1 + 2 * rows]
        sources = [self._view(pairs[2 * r], pairs[2 * r + 1]) for r in range(rows)]
        self._batches[batch_id] = original_merge_caches()(sources)
        return at + 1 + 2 * rows

    def _copy(self, batch_id: int, ops: tuple[int, ...], at: int) -> int:
        self._batches[ops[at]] = copy.deepcopy(self._batch(batch_id))
        return at + 1

    def _filter(self, batch_id: int, ops: tuple[int, ...], at: int) -> int:
        keep = list(ops[at + 1 : at + 1 + ops[at]])
        for layer in self._batch(batch_id):
            layer.filter(keep)
        return at + 1 + len(keep)

    def _extend(self, batch_id: int, ops: tuple[int, ...], at: int) -> int:
        for layer, other in zip(self._batch(batch_id), self._batch(ops[at]), strict=True):
            layer.extend(other)
        return at + 1

    def _extract(self, batch_id: int, ops: tuple[int, ...], at: int) -> int:
        self._caches[ops[at + 1]] = [layer.extract(ops[at]) for layer in self._batch(batch_id)]
        return at + 2

    def _prepare(self, batch_id: int, ops: tuple[int, ...], at: int) -> int:
        rows, flags = ops[at], ops[at + 1]
        at, kwargs = at + 2, {}
        for bit, name in enumerate(("left_padding", "lengths", "right_padding")):
            if flags & (1 << bit):
                kwargs[name] = list(ops[at : at + rows])
                at += rows
        for layer in self._batch(batch_id):
            layer.prepare(**kwargs)
        return at

    def _finalize(self, batch_id: int, ops: tuple[int, ...], at: int) -> int:
        for layer in self._batch(batch_id):
            layer.finalize()
        return at

    def _trim(self, batch_id: int, ops: tuple[int, ...], at: int) -> int:
        for layer in self._batch(batch_id):
            layer.trim(ops[at])
        return at + 1

    def _view(self, source: int, offset: int) -> list[Any]:
        """A batch row's source as rank 0 merged it: new, or a follower cache's first
        ``offset`` tokens (a shallow copy, trimmed: merging only reads it)."""
        from mlx_lm.models.cache import trim_prompt_cache

        if source == NEW:
            return self._make()
        view = [copy.copy(layer) for layer in self._cache(source)]
        excess = int(view[0].offset) - offset
        if excess > 0:
            trim_prompt_cache(view, excess)
        if int(view[0].offset) != offset:
            raise SplitCacheError(
                f"cache {source} holds {view[0].offset} tokens, rank 0's {offset}"
            )
        return view

    def _batch(self, batch_id: int) -> list[Any]:
        try:
            return self._batches[batch_id]
        except KeyError:
            raise SplitCacheError(f"no batch {batch_id} here: out of step with rank 0") from None

    def prepare(self, step: Step) -> list[Any]:
        """Replay ``step``'s batch operations, apply its drops, copy and trim; the cache its
        tokens run on."""
        from mlx_lm.models.cache import trim_prompt_cache

        self._replay(step.ops)
        self._drop(step.drops)
        if step.source == NEW:
            self._caches[step.cache] = self._make()
        elif step.source != KEEP:
            self._caches[step.cache] = copy.deepcopy(self._cache(step.source))
        cache = self._cache(step.cache)
        excess = int(cache[0].offset) - step.offset
        if excess > 0:
            trim_prompt_cache(cache, excess)
        if int(cache[0].offset) != step.offset:
            raise SplitCacheError(
                f"cache {step.cache} holds {cache[0].offset} tokens, rank 0's {step.offset}"
            )
        return cache

    def _cache(self, cache_id: int) -> list[Any]:
        try:
            return self._caches[cache_id]
        except KeyError:
            raise SplitCacheError(f"no cache {cache_id} here: out of step with rank 0") from None


_REPLAY: dict[int, Callable[[FollowerCaches, int, tuple[int, ...], int], int]] = {
    MERGE: FollowerCaches._merge,
    COPY: FollowerCaches._copy,
    FILTER: FollowerCaches._filter,
    EXTEND: FollowerCaches._extend,
    EXTRACT: FollowerCaches._extract,
    PREPARE: FollowerCaches._prepare,
    FINALIZE: FollowerCaches._finalize,
    TRIM: FollowerCaches._trim,
}
