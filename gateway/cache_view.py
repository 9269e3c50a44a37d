"""The mesh-wide view of prompt caches: per node and model, the memory tier, the disk tier, the
cached prefixes and the hit rate (and the memory budget), read from the status picture
(``gateway.status``) – this node's ``node.cache_stats`` and each peer's, as gossip brought them.

:func:`cache_rows` flattens the picture (pure; ``mesh status`` prints the rows, the console
draws the same fields); :class:`NodeCacheStats` exports them on the gateway's ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from worker.serve.metrics import table_families

# A row's field → (metric name, kind, help), labelled by node and model.
_METRICS = {
    "memory_bytes": ("prompt_cache_memory_bytes", "gauge", "bytes in the memory tier"),
    "disk_bytes": ("prompt_cache_disk_bytes", "gauge", "bytes in the disk tier"),
    "prefixes": ("prompt_cache_prefixes", "gauge", "distinct prefixes held in either tier"),
    "hit_rate": ("prompt_cache_hit_rate", "gauge", "lookups that found a prefix / lookups"),
    "cached_share": (
        "prompt_cache_cached_share",
        "gauge",
        "prompt tokens served from the cache / prompt tokens looked up",
    ),
    "lookups": ("prompt_cache_lookups", "counter", "prompt-cache lookups since the worker began"),
    "budget_bytes": ("memory_budget_bytes", "gauge", "the worker's memory budget"),
    "budget_used_bytes": ("memory_used_bytes", "gauge", "memory budget in use"),
}


def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def cache_rows(picture: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per node and model with a cache summary: this node first, then its peers in
    the picture's order. Each row: ``node_id``, ``self``, ``state``, ``model`` and the
    summary's numbers (missing ones None)."""
    node = picture.get("node")
    nodes: list[tuple[Mapping[str, Any], bool]] = []
    if isinstance(node, Mapping):
        nodes.append((node, True))
    nodes += [(p, False) for p in picture.get("peers") or () if isinstance(p, Mapping)]
    rows = []
    for entry, is_self in nodes:
        stats = entry.get("cache_stats")
        if not isinstance(stats, Mapping):
            continue  # an older peer: no summary
        for model in sorted(stats):
            summary = stats[model]
            if not isinstance(summary, Mapping):
                continue
            row: dict[str, Any] = {
                "node_id": str(entry.get("node_id") or entry.get("id") or "?"),
                "self": is_self,
                "state": str(entry.get("state") or "up"),
                "model": str(model),
            }
            row |= {key: _number(summary.get(key)) for key in _METRICS}
            rows.append(row)
    return rows


class NodeCacheStats:
    """The rows of the last picture (``update`` at each scrape), as ``gateway_node_*``
    families labelled ``node`` (the id's first 16 hex digits) and ``model``. A collector."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.rows: list[dict[str, Any]] = []
        registry.register(self)

    def update(self, picture: Mapping[str, Any]) -> None:
        self.rows = cache_rows(picture)

    def describe(self) -> list[Metric]:
        return []  # the nodes are known only at scrape time

    def collect(self) -> Iterator[Metric]:
        samples = [([row["node_id"][:16], row["model"]], row) for row in self.rows]
        yield from table_families(_METRICS, ["node", "model"], samples, "gateway_node_")
