"""The followers' KV caches of a split group, kept in step with rank 0's (pure bookkeeping).

Rank 0's engine copies, trims, stores, reuses and drops its per-sequence KV caches (the prompt
cache, a fork from a running sibling's prefill) without telling anyone; each follower must hold
the same caches for its own layers. Rather than hooking every place that does so, rank 0 keeps
a :class:`CacheLedger` and learns what happened at the one choke point every cache passes before
it is used: the forward pass (``worker.split.leader.LeaderModel``).

- Each cache rank 0 runs carries a :class:`CacheTag` (on its first layer's cache object) naming
  a follower cache id. A deep copy of the cache (``copy.deepcopy``: the store's fetch, a fork)
  deep-copies the tag, which counts one more holder of that id; a cache rank 0 lets go of
  (evicted, discarded, finished with) takes its tag with it, one holder fewer.
- Trimming only drops tokens from the end, and appending leaves the earlier positions' keys
  alone (causal attention), so what a cache holds is its follower cache's first ``offset``
  tokens: rank 0 never needs to know *which* tokens, only how many.
- Copy on write: a forward on a cache whose id has other holders first copies the follower
  cache to a new id (the others keep the old one unchanged); one with no other holder runs on
  it in place, trimmed to the offset first.

Each forward pass is one :class:`Step` (run on this id, copied from that one or new, trimmed to
this many tokens, after dropping those ids nobody on rank 0 holds any more), which the follower
applies with ``worker.split.replay.FollowerCaches``. Drops ride on the next step, so a follower never holds a
cache longer than rank 0 does by more than the time to its next forward pass, and never holds
one rank 0 has dropped when it computes.

Shallow copies (``copy.copy`` of a layer cache, which shares the tag and the arrays) cannot be
run on and are refused; merging one into a batch (the batched engine's, which only reads it) is
fine.

Batches (mlx-lm's ``BatchGenerator``: ``BatchKVCache``, ``BatchRotatingKVCache``) are mirrored
by replaying, not by diffing: mlx-lm builds a batch's cache with ``generate._merge_caches``
(wrapped on rank 0 by :func:`record_batches`) and changes it only through the batch cache's own
methods (``filter``, ``extend``, ``extract``, ``prepare``, ``finalize``, ``trim``, and
``copy.deepcopy`` when it splits a prefill batch), each called on every layer alike. Rank 0
gives each batch's first layer a recording subclass (its ``__class__`` swapped) that logs those
calls as ints (the batch by id, a merged or extracted sequence by its follower cache id), and
the log rides on the next step; a follower makes the same calls, in the same order, on its own
layers' caches, so its batch rows, padding and offsets equal rank 0's. Only caches this ledger
made or ran are merged (:meth:`CacheLedger.mark_fresh`); anyone else's merges are untouched.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from worker.mlx_lm_hooks import wrap_merge_caches, write_index

NEW = -1  # Step.source: start from a fresh cache
KEEP = -2  # Step.source: run on the cache as it is (trimmed to the offset)
TAG = "_split_tag"  # the attribute of a cache's first layer that holds its CacheTag
BATCH_TAG = "_split_batch"  # the attribute of a batch cache's first layer: its BatchTag
FRESH = "_split_fresh"  # a new cache's first layer: made for this ledger (a _Fresh)

# Batch operations, as logged (ints: the log rides in the lockstep's all_sum).
MERGE = 1  # MERGE batch n (source offset)*n: source a cache id or NEW
COPY = 2  # COPY batch new: copy.deepcopy
FILTER = 3  # FILTER batch n index*n
EXTEND = 4  # EXTEND batch other
EXTRACT = 5  # EXTRACT batch index cache: a new follower cache
PREPARE = 6  # PREPARE batch n flags left*n? lengths*n? right*n? (flags: 1, 2, 4)
FINALIZE = 7  # FINALIZE batch
TRIM = 8  # TRIM batch n


class SplitCacheError(Exception):
    """A cache whose contents the followers cannot reproduce."""


@dataclass(frozen=True, slots=True)
class Step:
    """One forward pass, as the followers apply it to their caches before running it."""

    cache: int  # the follower cache id (or batch id) the tokens run on
    source: int  # NEW, KEEP, or the id to copy ``cache`` from first; a batch's: its rows
    offset: int  # tokens the cache holds before this pass (the follower trims to it); a
    # batch's: its columns (the follower checks them)
    drops: tuple[int, ...] = ()  # ids rank 0 holds no longer: freed after the ops
    ops: tuple[int, ...] = ()  # batch operations since the last step: replayed first


class CacheTag:
    """Which follower cache a rank-0 cache mirrors. Lives in that cache's first layer object,
    so it is copied and freed with it."""

    def __init__(self, ledger: CacheLedger, cache_id: int) -> None:
        self.ledger = ledger
        self.id = cache_id
        self.owner: weakref.ref[Any] | None = None  # the layer object it was first run from

    def __deepcopy__(self, memo: dict[int, Any]) -> CacheTag:
        return self.ledger._copied(self)

    def __del__(self) -> None:
        # Any thread, any time (the garbage collector's): only queue it.
        self.ledger._dead.append(self.id)


class BatchTag:
    """Which follower batch a rank-0 batch cache mirrors (on its first layer object)."""

    def __init__(self, ledger: CacheLedger, batch_id: int) -> None:
        self.ledger = ledger
        self.id = batch_id

    def __deepcopy__(self, memo: dict[int, Any]) -> BatchTag:
        return self.ledger._batch_copied(self)

    def __del__(self) -> None:
        self.ledger._dead.append(self.id)


class _Fresh:
    """Marks a new cache's first layer as made for ``ledger`` (copies share the mark)."""

    def __init__(self, ledger: CacheLedger) -> None:
        self.ledger = weakref.ref(ledger)

    def __copy__(self) -> _Fresh:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _Fresh:
        return self


class CacheLedger:
    """Rank 0's record of the followers' caches: who holds each id and how many tokens the
    follower cache has. Owned by the engine's thread (``plan``/``ran``); tags die anywhere."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._held: dict[int, int] = {}  # tokens in the follower cache
        self._dead: deque[int] = deque()  # ids of tags that died, not yet counted
        self._dropped: list[int] = []  # ids nobody holds, for the next step to free
        self._log: list[int] = []  # batch operations since the last step
        self._next = 0

    def __len__(self) -> int:
        """Follower caches that stay alive once the next step's drops are applied."""
        self._collect()
        return len(self._held)

    def plan(self, cache: list[Any]) -> Step:
        """The step that makes the followers' cache for ``cache`` hold what it holds now
        (raises :class:`SplitCacheError`, changing nothing, if they cannot)."""
        self._collect()
        cache_id, source, offset = self._place(cache[0])
        return Step(cache_id, source, offset, *self._take())

    def plan_batch(self, cache: list[Any], rows: int) -> Step:
        """The step of a forward pass on a batch cache: its id, its ``rows`` (``source``), its
        columns before the pass (``offset``, the followers check theirs), and the batch
        operations since the last step, which the followers replay first."""
        self._collect()
        tag = cache[0].__dict__.get(BATCH_TAG)
        if tag is None or tag.ledger is not self:
            raise SplitCacheError("a batch whose making its followers never saw")
        return Step(tag.id, rows, batch_columns(cache[0]), *self._take())

    def mark_fresh(self, cache: list[Any]) -> list[Any]:
        """Mark a new cache as this ledger's: merging it into a batch is then recorded."""
        if cache:
            setattr(cache[0], FRESH, _Fresh(self))
        return cache

    def merged(self, caches: list[list[Any]], batch: list[Any]) -> None:
        """mlx-lm merged ``caches`` into ``batch``: tag it, give its first layer the recording
        class, log where each row came from (a follower cache read at this offset, or new)."""
        sources: list[int] = []
        for cache in caches:
            first = cache[0]
            offset = int(first.offset)
            tag = first.__dict__.get(TAG)
            if tag is None or tag.ledger is not self:
                if offset:
                    raise SplitCacheError("a batch row that holds tokens its followers never saw")
                sources += [NEW, 0]
                continue
            held = self._held[tag.id]
            if offset > held:
                raise SplitCacheError(
                    f"a cache grew behind its followers' back ({offset} > {held})"
                )
            sources += [tag.id, offset]
        batch_id = self._new_batch()
        first = batch[0]
        first.__class__ = _recording(type(first))
        setattr(first, BATCH_TAG, BatchTag(self, batch_id))
        self._log += [MERGE, batch_id, len(caches), *sources]

    def _take(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        drops, self._dropped = tuple(self._dropped), []
        ops, self._log = tuple(self._log), []
        return drops, ops

    def _new_batch(self) -> int:
        batch_id = self._new_id()
        self._holders[batch_id] = 1
        self._held[batch_id] = 0
        return batch_id

    def _batch_copied(self, tag: BatchTag) -> BatchTag:
        copied = BatchTag(self, self._new_batch())
        self._log += [COPY, tag.id, copied.id]
        return copied

    def _extracted(self, batch: BatchTag, index: int, cache: Any) -> None:
        tag = CacheTag(self, self._new_id())
        tag.owner = weakref.ref(cache)
        setattr(cache, TAG, tag)
        self._holders[tag.id] = 1
        self._held[tag.id] = int(cache.offset)
        self._log += [EXTRACT, batch.id, index, tag.id]

    def _record(self, *ints: int) -> None:
        self._log += ints

    def _place(self, first: Any) -> tuple[int, int, int]:
        offset = int(first.offset)
        tag = first.__dict__.get(TAG)
        if tag is None or tag.ledger is not self:
            if offset:
                raise SplitCacheError("a cache that holds tokens its followers never saw")
            tag = CacheTag(self, self._new_id())
            tag.owner = weakref.ref(first)
            setattr(first, TAG, tag)
            self._holders[tag.id] = 1
            self._held[tag.id] = 0
            return tag.id, NEW, 0
        if tag.owner is not None and tag.owner() is not first:
            raise SplitCacheError("a shallow copy of a cache (shared arrays) cannot be mirrored")
        held = self._held[tag.id]
        if offset > held:
            raise SplitCacheError(f"a cache grew behind its followers' back ({offset} > {held})")
        tag.owner = weakref.ref(first)  # a deep copy's tag: its first run
        if self._holders[tag.id] == 1:
            self._held[tag.id] = offset
            return tag.id, KEEP, offset
        # Copy on write: the other holders keep the follower cache as it is.
        source = tag.id
        self._holders[source] -= 1
        tag.id = self._new_id()
        self._holders[tag.id] = 1
        self._held[tag.id] = offset
        return tag.id, source, offset

    def ran(self, step: Step, tokens: int) -> None:
        """The followers ran ``tokens`` more on ``step.cache``."""
        self._held[step.cache] = step.offset + tokens

    def _new_id(self) -> int:
        self._next += 1
        return self._next

    def _copied(self, tag: CacheTag) -> CacheTag:
        self._holders[tag.id] += 1  # a copy happens on the engine's thread, as plan does
        return CacheTag(self, tag.id)

    def _collect(self) -> None:
        """Count the tags that died; the ids nobody holds now are for the followers to free."""
        while self._dead:
            cache_id = self._dead.popleft()
            if cache_id not in self._holders:
                continue
            self._holders[cache_id] -= 1
            if self._holders[cache_id] <= 0:
                del self._holders[cache_id]
                del self._held[cache_id]
                self._dropped.append(cache_id)


def batch_columns(first: Any) -> int:
    """A batch cache's columns (its rows' common length, padding included)."""
    return write_index(first)


def batch_rows(first: Any) -> int:
    """A batch cache's rows."""
    return int(first.offset.shape[0])


def _ints(values: Any) -> list[int]:
    return [int(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]


_RECORDING: dict[type, type] = {}


def _recording(cls: type) -> type:
    """``cls`` (a batch cache class) whose every change is logged to its ledger first."""
    if cls in _RECORDING or cls in _RECORDING.values():
        return _RECORDING.get(cls, cls)

    def tag(cache: Any) -> BatchTag:
        found: BatchTag = cache.__dict__[BATCH_TAG]
        return found

    class Recording(cls):  # type: ignore[misc, valid-type]
        def filter(self, batch_indices: Any) -> Any:
            keep = _ints(batch_indices)
            tag(self).ledger._record(FILTER, tag(self).id, len(keep), *keep)
            return super().filter(batch_indices)

        def extend(self, other: Any) -> Any:
            theirs = other.__dict__.get(BATCH_TAG)
            if theirs is None or theirs.ledger is not tag(self).ledger:
                raise SplitCacheError("extending a batch with one its followers never saw")
            tag(self).ledger._record(EXTEND, tag(self).id, theirs.id)
            return super().extend(other)

        def extract(self, idx: int) -> Any:
            cache = super().extract(idx)
            tag(self).ledger._extracted(tag(self), int(idx), cache)
            return cache

        def prepare(
            self, *, left_padding: Any = None, lengths: Any = None, right_padding: Any = None
        ) -> Any:
            parts = [
                _ints(v) if v is not None else None for v in (left_padding, lengths, right_padding)
            ]
            given = [p for p in parts if p is not None]
            flags = sum(1 << i for i, p in enumerate(parts) if p is not None)
            rows = len(given[0]) if given else 0
            values = [v for p in given for v in p]
            tag(self).ledger._record(PREPARE, tag(self).id, rows, flags, *values)
            return super().prepare(
                left_padding=left_padding, lengths=lengths, right_padding=right_padding
            )

        def finalize(self) -> Any:
            tag(self).ledger._record(FINALIZE, tag(self).id)
            return super().finalize()

        def trim(self, n: int) -> Any:
            tag(self).ledger._record(TRIM, tag(self).id, int(n))
            return super().trim(n)

    Recording.__name__ = Recording.__qualname__ = f"Recording{cls.__name__}"
    _RECORDING[cls] = Recording
    return Recording


def record_batches() -> None:
    """Wrap mlx-lm's ``generate._merge_caches`` (once per process, on rank 0; through
    worker/mlx_lm_hooks.py): a merge of a ledger's caches is recorded by that ledger; any other
    merge is left alone."""

    def recording(merge: Callable[[list[list[Any]]], list[Any]]) -> Callable[..., Any]:
        def recorded(caches: list[list[Any]]) -> list[Any]:
            ledger = _ledger_of(caches)
            batch = merge(caches)
            if ledger is not None and batch:
                ledger.merged(caches, batch)
            return batch

        return recorded

    wrap_merge_caches(recording)


def _ledger_of(caches: list[list[Any]]) -> CacheLedger | None:
    for cache in caches:
        first = cache[0].__dict__ if cache else {}
        if (tag := first.get(TAG)) is not None:
            return tag.ledger  # type: ignore[no-any-return]
        if (fresh := first.get(FRESH)) is not None:
            return fresh.ledger()  # type: ignore[no-any-return]
    return None
