"""Prompt (KV) cache store: reuse the longest cached token prefix across requests.

Entries are (tokens, per-layer KV cache) pairs kept in LRU order and bounded by bytes. A lookup
returns a *copy* of the best entry trimmed to the shared prefix, so the stored entry is never
mutated by generation. Only the engine's owner thread touches a store (MLX arrays are not shared
across threads here).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, trim_prompt_cache

from worker.prompt_cache.digest import DEFAULT_BLOCK_SIZE, CacheDigest, block_hashes


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the shared prefix: binary search on slice equality (compared in C)."""
    a, b = list(a), list(b)
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def copy_cache(cache: list[Any], *, merged_by_reader: bool) -> list[Any]:
    """A private copy of a per-layer KV cache that generation can extend or trim.

    ``merged_by_reader``: the reader only merges it into a batch (mlx-lm's
    ``BatchKVCache.merge`` copies ``keys[..., :offset]``), so plain ``KVCache`` layers are copied
    shallowly (new objects, shared arrays) instead of duplicating every tensor. Anything else,
    e.g. a cache the sequential generator writes into in place, is copied deeply."""
    if merged_by_reader and all(type(c) is KVCache for c in cache):
        return [copy.copy(c) for c in cache]
    return copy.deepcopy(cache)


def materialize(cache: list[Any]) -> None:
    """Evaluate a cache's arrays now. A row extracted from a batch (``BatchKVCache.extract``) is
    a lazy copy: stored as is it keeps the whole batch's buffer alive, uncounted, and the copy
    runs inside the next turn's first forward pass – on its time to first token."""
    states = [c.state for c in cache if not (hasattr(c, "empty") and c.empty())]
    arrays = [v for _, v in tree_flatten(states) if isinstance(v, mx.array)]
    if arrays:
        mx.eval(arrays)


def cache_nbytes(cache: list[Any]) -> int:
    return sum(getattr(c, "nbytes", 0) for c in cache)


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    cache: list[Any]
    nbytes: int
    trimmable: bool
    chain: list[int] = field(default_factory=list)  # block_hashes(tokens), for the digest


@dataclass
class PromptCacheStats:
    hits: int = 0
    misses: int = 0
    inserts: int = 0
    evictions: int = 0
    cached_tokens: int = 0


@dataclass
class PromptCacheStore:
    """LRU store of KV caches keyed by the tokens they hold, bounded by ``max_bytes``."""

    max_bytes: int = 2 << 30
    max_entries: int = 64
    stats: PromptCacheStats = field(default_factory=PromptCacheStats)
    _entries: OrderedDict[int, _Entry] = field(default_factory=OrderedDict)
    _next_key: int = 0
    # What the store holds, for routing by prefix (worker/prompt_cache/digest.py). Rebuilt on the
    # owner thread after every change and swapped in whole, so other threads read it safely.
    digest: CacheDigest = field(default_factory=CacheDigest)
    digest_block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def usable_prefix(
        self, entry_tokens: Sequence[int], prompt: Sequence[int], trimmable: bool
    ) -> int:
        """Tokens of ``prompt`` an entry can serve (at least one prompt token is left to run)."""
        shared = min(common_prefix(entry_tokens, prompt), len(prompt) - 1)
        if shared <= 0:
            return 0
        if shared < len(entry_tokens) and not trimmable:
            return 0
        return shared

    def best_prefix(self, prompt: Sequence[int]) -> int:
        """How many prompt tokens a lookup would serve from the cache (no copy, no LRU touch)."""
        return max(
            (self.usable_prefix(e.tokens, prompt, e.trimmable) for e in self._entries.values()),
            default=0,
        )

    def fetch(
        self, prompt: Sequence[int], *, merged_by_reader: bool = False
    ) -> tuple[list[Any] | None, int]:
        """A private copy of the best cache for ``prompt`` and how many tokens it covers
        (``merged_by_reader``: see :func:`copy_cache`)."""
        best_key, best_len = None, 0
        for key, entry in self._entries.items():
            n = self.usable_prefix(entry.tokens, prompt, entry.trimmable)
            if n > best_len:
                best_key, best_len = key, n
        if best_key is None:
            self.stats.misses += 1
            return None, 0
        entry = self._entries[best_key]
        self._entries.move_to_end(best_key)
        cache = copy_cache(entry.cache, merged_by_reader=merged_by_reader)
        excess = len(entry.tokens) - best_len
        if excess:
            trim_prompt_cache(cache, excess)
        self.stats.hits += 1
        self.stats.cached_tokens += best_len
        return cache, best_len

    def insert(self, tokens: Sequence[int], cache: list[Any]) -> None:
        """Store a cache holding exactly ``tokens``; entries it extends are dropped."""
        if not tokens or not cache:
            return
        materialize(cache)
        trimmable = can_trim_prompt_cache(cache)
        key_tokens = tuple(tokens)
        for key, entry in list(self._entries.items()):
            covered = common_prefix(entry.tokens, key_tokens) == len(entry.tokens)
            if covered and (trimmable or entry.tokens == key_tokens):
                del self._entries[key]
        chain = block_hashes(key_tokens, self.digest_block_size)
        entry = _Entry(key_tokens, cache, cache_nbytes(cache), trimmable, chain)
        self._entries[self._next_key] = entry
        self._next_key += 1
        self.stats.inserts += 1
        self._evict()
        self._refresh_digest()

    def _refresh_digest(self) -> None:
        # Most recently inserted first: they get the first share of the digest's bound. A
        # prefix of an untrimmable entry is not servable, so it advertises its whole length only.
        chains = [e.chain if e.trimmable else e.chain[-1:] for e in reversed(self._entries.values())]  # fmt: skip
        self.digest = CacheDigest.of_chains(chains, block_size=self.digest_block_size)

    def _evict(self) -> None:
        total = self.nbytes
        while self._entries and (total > self.max_bytes or len(self._entries) > self.max_entries):
            _, dropped = self._entries.popitem(last=False)
            total -= dropped.nbytes
            self.stats.evictions += 1

    def clear(self) -> None:
        self._entries.clear()
        self._refresh_digest()
