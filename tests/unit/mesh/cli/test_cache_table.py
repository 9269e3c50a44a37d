"""``mesh status``'s prompt-cache table: one row per node and model, in words a person reads."""

from __future__ import annotations

from mesh.cli.cache_view import COLUMNS, cache_cells

PICTURE = {
    "node": {
        "node_id": "a" * 64,
        "cache_stats": {
            "m": {
                "memory_bytes": 3_000_000,
                "disk_bytes": 70_000_000,
                "prefixes": 5,
                "lookups": 4,
                "hit_rate": 0.75,
                "cached_share": 0.5,
                "budget_bytes": 10**9,
                "budget_used_bytes": 4_000_000,
            },
        },
    },
    "peers": [
        {"node_id": "b" * 64, "state": "down", "cache_stats": {"m": {"memory_bytes": 0}}},
        {"node_id": "c" * 64, "state": "up", "models": [{"name": "m"}]},  # older: no summary
    ],
}


def test_every_node_with_a_summary_gets_a_row() -> None:
    assert cache_cells(PICTURE) == [
        ["this node", "m", "3.0 MB", "70.0 MB", "5", "75% of 4", "50%", "4.0 MB of 1.0 GB"],
        ["b" * 16 + " (down)", "m", "0 B", "-", "-", "-", "-", "no budget"],
    ]
    assert len(COLUMNS) == len(cache_cells(PICTURE)[0])


def test_no_summaries_no_table() -> None:
    assert cache_cells({"node": {"node_id": "a"}, "peers": []}) == []
