"""An /api/status picture of a node with split models, for the tests of what draws it (the
console's Mesh tab, ``mesh status``): this node heads BIG over three nodes (layers 0-9 on B,
10-17 on C, 18-23 here), waits for memory for HUGE, and runs a rank of OTHER for C."""

from __future__ import annotations

from typing import Any

SELF, B, C = "a" * 64, "b1" * 32, "c2" * 32
WHY = "HUGE needs 41.0 GB and the members offer 12.0 GB: offer more with mesh up --share-memory GB."
STAGES = [
    {"rank": 2, "node_id": B, "start": 0, "end": 10},
    {"rank": 1, "node_id": C, "start": 10, "end": 18},
    {"rank": 0, "node_id": SELF, "start": 18, "end": 24},
]


def split_node() -> dict[str, Any]:
    """The picture's ``node`` part (each test adds the peers it needs)."""
    return {
        "node_id": SELF,
        "models": [{"name": "tiny", "stages": []}, {"name": "BIG", "stages": STAGES}],
        "share_memory": 4_000_000_000,
        "share_memory_used": 1_200_000_000,
        "split": {
            "share_memory": 4_000_000_000,
            "share_memory_used": 1_200_000_000,
            "ranks": [{"group": "g1", "model": "OTHER", "rank": 1, "head": C}],
            "groups": {"BIG": STAGES},
            "waiting": {"HUGE": WHY},
        },
    }
