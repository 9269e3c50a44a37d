"""The "prompt caches" table of ``mesh status``: per node and model, the memory tier, the disk
tier, the cached prefixes, the hit rate (lookups) and the share of prompt tokens served from
the cache, and the memory budget in use. Pure: the cells of
the rows :func:`gateway.cache_view.cache_rows` reads from the ``/api/status`` picture."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.cache_view import cache_rows
from mesh.cli.split_view import format_size

COLUMNS = (
    "node",
    "model",
    "memory",
    "disk",
    "prefixes",
    "hit rate",
    "tokens cached",
    "budget used",
)


def cache_cells(status: Mapping[str, Any]) -> list[list[str]]:
    """One list of cells per row, in :data:`COLUMNS` order; empty when no node reports one."""
    cells = []
    for row in cache_rows(status):
        node = "this node" if row["self"] else row["node_id"][:16]
        if row["state"] != "up":
            node += f" ({row['state']})"
        cells.append(
            [
                node,
                row["model"],
                _size(row["memory_bytes"]),
                _size(row["disk_bytes"]),
                "-" if row["prefixes"] is None else f"{row['prefixes']:.0f}",
                _rate(row["hit_rate"], row["lookups"]),
                "-" if row["cached_share"] is None else f"{row['cached_share']:.0%}",
                _budget(row["budget_used_bytes"], row["budget_bytes"]),
            ]
        )
    return cells


def _size(value: float | None) -> str:
    return "-" if value is None else format_size(int(value))


def _rate(rate: float | None, lookups: float | None) -> str:
    if rate is None:
        return "-"  # no lookup yet
    return f"{rate:.0%} of {lookups or 0:.0f}"


def _budget(used: float | None, limit: float | None) -> str:
    if limit is None:
        return "no budget"
    return f"{_size(used)} of {_size(limit)}"
