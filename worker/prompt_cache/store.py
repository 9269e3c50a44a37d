"""Prompt (KV) cache store: reuse the longest cached token prefix across requests.

Entries are (tokens, per-layer KV cache) pairs kept in LRU order and bounded by bytes. A lookup
returns a *copy* of the best entry trimmed to the shared prefix, so the stored entry is never
mutated by generation. Only the engine's owner thread touches a store (MLX arrays are not shared
across threads here).

With a disk tier (worker/prompt_cache/disk.py) the store is its memory tier: what it evicts goes
to disk, a long entry it stores goes there too at a bounded rate, and a lookup that finds a
longer prefix on disk than in memory (by ``DISK_GAIN_TOKENS``) loads it back.
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

from worker.prompt_cache.digest import (
    DEFAULT_BLOCK_SIZE,
    CacheDigest,
    block_hashes,
    common_blocks,
    common_prefix,
)
from worker.prompt_cache.disk import DiskTier, tokens_key

# A disk entry is loaded when it serves this many more prompt tokens than memory does: below
# it the prefill of the difference costs less than reading the file (SmolLM2 on the Linux CPU:
# ~0.5 s of prefill against ~0.1-0.3 s to read and check a cache of a few thousand tokens).
DISK_GAIN_TOKENS = 64


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
    key: str = ""  # tokens_key(tokens): the disk tier's name for the same prefix


@dataclass
class PromptCacheStats:
    hits: int = 0  # lookups that found a usable prefix
    misses: int = 0
    inserts: int = 0
    evictions: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0  # of the prompts looked up: cached_tokens / this is the cached share


@dataclass
class PromptCacheStore:
    """LRU store of KV caches keyed by the tokens they hold, bounded by ``max_bytes``."""

    max_bytes: int = 2 << 30
    max_entries: int = 64
    stats: PromptCacheStats = field(default_factory=PromptCacheStats)
    _entries: OrderedDict[int, _Entry] = field(default_factory=OrderedDict)
    _next_key: int = 0
    # The entries' bytes, kept as they come and go: the memory budget reads it every loop.
    _nbytes: int = 0
    # What the store holds, for routing by prefix (worker/prompt_cache/digest.py). Rebuilt on the
    # owner thread after every change and swapped in whole, so other threads read it safely.
    digest: CacheDigest = field(default_factory=CacheDigest)
    digest_block_size: int = DEFAULT_BLOCK_SIZE
    disk: DiskTier | None = None  # the disk tier, when the worker has a home for it
    # Distinct prefixes in either tier (one in both counts once), counted with the digest.
    prefixes: int = 0
    # Every entry's whole chain by tier, swapped in whole with the digest: the mesh's
    # routing-time question is answered from these exactly (the digest thins long chains).
    memory_chains: tuple[tuple[list[int], bool], ...] = ()  # (chain, trimmable)
    disk_chains: tuple[list[int], ...] = ()

    def __post_init__(self) -> None:
        if self.disk is not None:
            self._refresh_digest()  # what the disk holds is servable from the start

    @property
    def nbytes(self) -> int:
        return self._nbytes

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

    def _best_in_memory(self, prompt: Sequence[int]) -> int:
        return max(
            (self.usable_prefix(e.tokens, prompt, e.trimmable) for e in self._entries.values()),
            default=0,
        )

    def best_prefix(self, prompt: Sequence[int]) -> int:
        """How many prompt tokens a lookup would serve from the cache (no copy, no LRU touch)."""
        in_memory = self._best_in_memory(prompt)
        if self.disk is None:
            return in_memory
        return max(in_memory, self.disk.best(prompt)[1])

    def _restore(self, prompt: Sequence[int]) -> None:
        """Load the disk entry that serves ``prompt`` better than memory does, into memory."""
        assert self.disk is not None
        entry, on_disk = self.disk.best(prompt)
        if entry is None:
            return
        if on_disk < self._best_in_memory(prompt) + DISK_GAIN_TOKENS:
            return
        cache = self.disk.load(entry)
        if cache is not None:
            self.insert(entry.tokens, cache, from_disk=True)

    def fetch(
        self, prompt: Sequence[int], *, merged_by_reader: bool = False, counted: bool = True
    ) -> tuple[list[Any] | None, int]:
        """A private copy of the best cache for ``prompt`` and how many tokens it covers
        (``merged_by_reader``: see :func:`copy_cache`; ``counted``: a request's lookup, in
        the hit counts – the engine's own are not)."""
        stats = self.stats if counted else PromptCacheStats()
        stats.prompt_tokens += len(prompt)
        if self.disk is not None:
            self._restore(prompt)
        best_key, best_len = None, 0
        for key, entry in self._entries.items():
            n = self.usable_prefix(entry.tokens, prompt, entry.trimmable)
            if n > best_len:
                best_key, best_len = key, n
        if best_key is None:
            stats.misses += 1
            return None, 0
        entry = self._entries[best_key]
        self._entries.move_to_end(best_key)
        cache = copy_cache(entry.cache, merged_by_reader=merged_by_reader)
        excess = len(entry.tokens) - best_len
        if excess:
            trim_prompt_cache(cache, excess)
        stats.hits += 1
        stats.cached_tokens += best_len
        return cache, best_len

    def insert(
        self,
        tokens: Sequence[int],
        cache: list[Any],
        *,
        from_disk: bool = False,
        chain: Sequence[int] | None = None,
    ) -> None:
        """Store a cache holding exactly ``tokens``; entries it extends are dropped. A long one
        goes to the disk tier too, at most one every ``hot_interval_s`` (a node killed later
        still finds it); what memory evicts goes there in any case. ``chain``: the tokens'
        :func:`block_hashes` when the caller has them (a pending commit does)."""
        if not tokens or not cache:
            return
        materialize(cache)
        trimmable = can_trim_prompt_cache(cache)
        key_tokens = tuple(tokens)
        for key, entry in list(self._entries.items()):
            covered = common_prefix(entry.tokens, key_tokens) == len(entry.tokens)
            if covered and (trimmable or entry.tokens == key_tokens):
                del self._entries[key]
                self._nbytes -= entry.nbytes
        hashes = list(chain) if chain is not None else block_hashes(key_tokens, self.digest_block_size)  # fmt: skip
        entry = _Entry(key_tokens, cache, cache_nbytes(cache), trimmable, hashes)
        if self.disk is not None:  # only a disk tier can hold the same prefix twice
            entry.key = tokens_key(key_tokens)
        self._entries[self._next_key] = entry
        self._nbytes += entry.nbytes
        self._next_key += 1
        self.stats.inserts += 1
        if self.disk is not None and not from_disk:
            self.disk.save(key_tokens, cache, hot=True)
        self._evict()
        self._refresh_digest()

    def summary(self) -> dict[str, Any]:
        """The memory tier's size and bound, ``prefixes`` (distinct, in either tier), the
        lookups' hits and misses, and the prompt tokens looked up and served from the cache.
        Plain numbers kept by the owner thread: safe to read from any thread (/health)."""
        stats = self.stats
        return {
            "entries": len(self._entries),
            "bytes": self._nbytes,
            "max_bytes": self.max_bytes,
            "prefixes": self.prefixes,
            "hits": stats.hits,
            "misses": stats.misses,
            "prompt_tokens": stats.prompt_tokens,
            "cached_tokens": stats.cached_tokens,
            "evictions": stats.evictions,  # to the disk tier when there is one, else dropped
        }

    def flush_to_disk(self) -> int:
        """Write every entry worth keeping that the disk tier lacks (at shutdown); how many."""
        if self.disk is None:
            return 0
        written = 0
        for entry in self._entries.values():
            self.disk.flush()  # one entry's copy in flight at a time, not the whole tier's
            written += self.disk.save(entry.tokens, entry.cache)
        self.disk.flush()
        return written

    def _refresh_digest(self) -> None:
        # Most recently inserted first: they get the first share of the digest's bound. A
        # prefix of an untrimmable entry is not servable, so it advertises its whole length only.
        chains = [e.chain if e.trimmable else e.chain[-1:] for e in reversed(self._entries.values())]  # fmt: skip
        disk_chains = self.disk.chains() if self.disk is not None else []
        self.prefixes = len(self._entries)
        if self.disk is not None:  # after memory's: restoring costs a read, not a prefill
            chains += disk_chains
            self.prefixes = len({e.key for e in self._entries.values()} | self.disk.keys())
        self.digest = CacheDigest.of_chains(chains, block_size=self.digest_block_size)
        # The chains themselves, never changed once made: no copies, only a new tuple of them.
        self.memory_chains = tuple((e.chain, e.trimmable) for e in self._entries.values())
        self.disk_chains = tuple(disk_chains)

    def held(self, hashes: Sequence[int]) -> tuple[int, int]:
        """Blocks of a prompt (its block hashes) the memory tier and the disk tier hold; any
        thread (it reads the last published chains). An entry that cannot be trimmed serves
        only a prompt that extends all of it."""
        memory = 0
        for chain, trimmable in self.memory_chains:
            shared = common_blocks(chain, hashes)
            if trimmable or shared == len(chain):
                memory = max(memory, shared)
        disk = max((common_blocks(c, hashes) for c in self.disk_chains), default=0)
        return memory, disk

    def spill(self, nbytes: int) -> int:
        """Give up at least ``nbytes`` of memory, least recently used first: to the disk tier
        when there is one, else dropped (the memory budget makes room so); bytes freed."""
        freed = 0
        while self._entries and freed < nbytes:
            freed += self._evict_oldest()
        if freed:
            self._refresh_digest()
        return freed

    def _evict(self) -> None:
        while self._entries and (
            self._nbytes > self.max_bytes or len(self._entries) > self.max_entries
        ):
            self._evict_oldest()

    def _evict_oldest(self) -> int:
        """Drop the least recently used entry (to the disk tier when there is one); its bytes."""
        _, dropped = self._entries.popitem(last=False)
        self._nbytes -= dropped.nbytes
        self.stats.evictions += 1
        if self.disk is not None:
            self.disk.save(dropped.tokens, dropped.cache)
        return dropped.nbytes

    def clear(self, *, forget_written: bool = False) -> None:
        """Forget every entry in memory; ``forget_written``: also what this process wrote to
        disk (the start-up warm-up's prompts are no user's)."""
        self._entries.clear()
        self._nbytes = 0
        if self.disk is not None and forget_written:
            self.disk.forget_written()
        self._refresh_digest()
