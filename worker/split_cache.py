"""The followers' KV caches of a split group, kept in step with rank 0's (pure bookkeeping).

Rank 0's engine copies, trims, stores, reuses and drops its per-sequence KV caches (the prompt
cache, a fork from a running sibling's prefill) without telling anyone; each follower must hold
the same caches for its own layers. Rather than hooking every place that does so, rank 0 keeps
a :class:`CacheLedger` and learns what happened at the one choke point every cache passes before
it is used: the forward pass (``worker.split_rank.LeaderModel``).

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
applies with :class:`FollowerCaches`. Drops ride on the next step, so a follower never holds a
cache longer than rank 0 does by more than the time to its next forward pass, and never holds
one rank 0 has dropped when it computes.

Shallow copies (``copy.copy`` of a layer cache, which shares the tag and the arrays: the batched
engine's, immediately merged into a batch) cannot be mirrored and are refused.
"""

from __future__ import annotations

import copy
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

NEW = -1  # Step.source: start from a fresh cache
KEEP = -2  # Step.source: run on the cache as it is (trimmed to the offset)
TAG = "_split_tag"  # the attribute of a cache's first layer that holds its CacheTag


class SplitCacheError(Exception):
    """A cache whose contents the followers cannot reproduce."""


@dataclass(frozen=True, slots=True)
class Step:
    """One forward pass, as the followers apply it to their caches before running it."""

    cache: int  # the follower cache id the tokens run on
    source: int  # NEW, KEEP, or the id to copy ``cache`` from first
    offset: int  # tokens the cache holds before this pass (the follower trims to it)
    drops: tuple[int, ...] = ()  # ids rank 0 holds no longer: freed first


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


class CacheLedger:
    """Rank 0's record of the followers' caches: who holds each id and how many tokens the
    follower cache has. Owned by the engine's thread (``plan``/``ran``); tags die anywhere."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._held: dict[int, int] = {}  # tokens in the follower cache
        self._dead: deque[int] = deque()  # ids of tags that died, not yet counted
        self._dropped: list[int] = []  # ids nobody holds, for the next step to free
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
        drops, self._dropped = tuple(self._dropped), []
        return Step(cache_id, source, offset, drops)

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


class FollowerCaches:
    """A follower's caches by id, changed only as rank 0's steps say."""

    def __init__(self, make: Callable[[], list[Any]]) -> None:
        self._make = make
        self._caches: dict[int, list[Any]] = {}

    def __len__(self) -> int:
        return len(self._caches)

    def prepare(self, step: Step) -> list[Any]:
        """Apply ``step``'s drops, copy and trim; the cache its tokens run on."""
        from mlx_lm.models.cache import trim_prompt_cache

        for cache_id in step.drops:
            self._caches.pop(cache_id, None)
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
