"""The memory tier's summary (/health ``prompt_cache``, /metrics, the gossiped view): sizes,
hits and misses, and distinct prefixes over both tiers – one held in both counts once."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from worker.prompt_cache.disk import DiskTier, DiskTierConfig
from worker.prompt_cache.store import PromptCacheStore


def kv(tokens: int) -> list[KVCache]:
    layer = KVCache()
    layer.update_and_fetch(mx.zeros((1, 2, tokens, 8)), mx.zeros((1, 2, tokens, 8)))
    return [layer]


def test_an_empty_store_says_zero_everywhere() -> None:
    summary = PromptCacheStore(max_bytes=1 << 20).summary()
    assert summary == {
        "entries": 0,
        "bytes": 0,
        "max_bytes": 1 << 20,
        "prefixes": 0,
        "hits": 0,
        "misses": 0,
        "prompt_tokens": 0,
        "cached_tokens": 0,
        "evictions": 0,
    }


def test_hits_misses_and_bytes_follow_the_lookups() -> None:
    store = PromptCacheStore()
    store.fetch([1, 2, 3])  # nothing cached: a miss
    store.insert(list(range(20)), kv(20))
    cache, n = store.fetch([*range(10), 99])
    assert cache is not None and n == 10
    summary = store.summary()
    assert (summary["hits"], summary["misses"]) == (1, 1)
    assert (summary["prompt_tokens"], summary["cached_tokens"]) == (3 + 11, 10)
    assert summary["entries"] == summary["prefixes"] == 1
    assert summary["bytes"] == store.nbytes > 0


def test_a_prefix_on_disk_and_in_memory_counts_once(tmp_path: Path) -> None:
    disk = DiskTier(DiskTierConfig(str(tmp_path), 1 << 30, "m", min_tokens=8, hot_interval_s=0))
    store = PromptCacheStore(disk=disk, max_entries=1)
    store.insert(list(range(20)), kv(20))  # hot: written to disk, kept in memory
    assert store.summary()["prefixes"] == 1  # on its way to disk: one prefix all the same
    disk.flush()
    assert len(disk) == 1
    assert store.summary()["prefixes"] == 1
    store.insert([50 + i for i in range(30)], kv(30))  # evicts the first one: on disk only
    disk.flush()
    summary = store.summary()
    assert summary["entries"] == 1 and len(disk) == 2
    assert summary["prefixes"] == 2
