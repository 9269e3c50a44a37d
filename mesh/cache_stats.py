"""Each node's prompt cache in brief, per model, as gossip carries it to the mesh. Pure.

A worker's ``/health`` (worker/serve/app.py) says a lot about its prompt cache and memory
budget; the mesh needs four numbers of it per model (``mesh status``, the console, the
gateway's ``/metrics``): the memory tier's bytes, the disk tier's bytes, the distinct prefixes
held, and the share of lookups that hit (and of prompt tokens served from the cache) – plus the
budget and its use when there is one. The
summary is a few dozen bytes a model, so a node's state stays small however big its cache is.

Every field has a default: a node of an older version sends none (``NodeState.cache_stats``
empty), one of a newer version may send more (ignored here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

T = TypeVar("T")

MAX_MODELS = 32  # a node gossips the summaries of at most this many models


class CacheStatsAd(BaseModel):
    """One model's prompt cache on one node, as last probed (at most a gossip interval old)."""

    model_config = ConfigDict(extra="ignore")  # newer peers may add fields

    memory_bytes: int = 0  # the memory tier
    disk_bytes: int = 0  # the disk tier (0: none, or empty)
    prefixes: int = 0  # distinct prefixes held in either tier
    lookups: int = 0  # since the worker started (its warm-up's not counted)
    hit_rate: float | None = None  # hits / lookups; None before the first lookup
    # Prompt tokens served from the cache / prompt tokens looked up (a hit may reuse only the
    # chat template's opening; this says how much of the prompts the cache saved).
    cached_share: float | None = None
    budget_bytes: int | None = None  # the worker's memory budget (None: no budget)
    budget_used_bytes: int | None = None  # running KV + the memory tier + pending commits


def _int(block: Mapping[str, Any] | None, key: str) -> int | None:
    value = None if block is None else block.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return max(0, int(value))
    return None


def _block(health: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    block = health.get(key)
    return block if isinstance(block, Mapping) else None


def summarise(health: Mapping[str, Any]) -> CacheStatsAd | None:
    """The summary of a worker's ``/health`` body; None for a worker that reports no
    ``prompt_cache`` block (an older one)."""
    memory_tier = _block(health, "prompt_cache")
    if memory_tier is None:
        return None
    disk = _block(health, "prompt_cache_disk")
    budget = _block(health, "memory")
    hits, misses = _int(memory_tier, "hits") or 0, _int(memory_tier, "misses") or 0
    lookups = hits + misses
    looked_up, cached = _int(memory_tier, "prompt_tokens") or 0, _int(memory_tier, "cached_tokens")
    return CacheStatsAd(
        memory_bytes=_int(memory_tier, "bytes") or 0,
        disk_bytes=_int(disk, "bytes") or 0,
        prefixes=_int(memory_tier, "prefixes") or 0,
        lookups=lookups,
        hit_rate=round(hits / lookups, 3) if lookups else None,
        cached_share=round(min(1.0, (cached or 0) / looked_up), 3) if looked_up else None,
        budget_bytes=_int(budget, "limit_bytes"),
        budget_used_bytes=_int(budget, "used_bytes"),
    )


def bounded(stats: Mapping[str, T]) -> dict[str, T]:
    """At most ``MAX_MODELS`` summaries, by model name: what one node's state carries."""
    return {model: stats[model] for model in sorted(stats)[:MAX_MODELS]}
