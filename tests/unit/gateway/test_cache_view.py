"""The mesh-wide cache view from the status picture: rows per node and model, and the
gateway's /metrics families labelled by node and model."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from gateway.cache_view import NodeCacheStats, cache_rows

SUMMARY = {"memory_bytes": 3000, "disk_bytes": 70000, "prefixes": 5, "lookups": 4,
           "hit_rate": 0.75, "cached_share": 0.5, "budget_bytes": 10**6, "budget_used_bytes": 4000}  # fmt: skip
PICTURE = {
    "node": {"node_id": "a" * 64, "cache_stats": {"m": SUMMARY}},
    "peers": [
        {"node_id": "b" * 64, "state": "down", "cache_stats": {"m": {"prefixes": 1}}},
        {"node_id": "c" * 64, "state": "up"},  # an older peer: no summary
        {"node_id": "d" * 64, "cache_stats": {"m": "garbage"}},
    ],
}


def test_rows_are_this_node_then_peers_with_missing_numbers_none() -> None:
    rows = cache_rows(PICTURE)
    assert [(r["node_id"][0], r["self"], r["state"]) for r in rows] == [
        ("a", True, "up"),
        ("b", False, "down"),
    ]
    assert rows[0]["hit_rate"] == 0.75 and rows[0]["disk_bytes"] == 70000.0
    assert rows[1]["prefixes"] == 1.0 and rows[1]["memory_bytes"] is None


def test_a_picture_without_a_mesh_has_no_rows() -> None:
    assert cache_rows({"node": {"id": "local", "models": ["m"]}, "peers": []}) == []
    assert cache_rows({}) == []


def test_metrics_per_node_and_model() -> None:
    registry = CollectorRegistry()
    stats = NodeCacheStats(registry)
    stats.update(PICTURE)
    text = generate_latest(registry).decode()
    a, b = "a" * 16, "b" * 16
    for line in (
        f'gateway_node_prompt_cache_memory_bytes{{model="m",node="{a}"}} 3000.0',
        f'gateway_node_prompt_cache_disk_bytes{{model="m",node="{a}"}} 70000.0',
        f'gateway_node_prompt_cache_prefixes{{model="m",node="{a}"}} 5.0',
        f'gateway_node_prompt_cache_hit_rate{{model="m",node="{a}"}} 0.75',
        f'gateway_node_prompt_cache_lookups_total{{model="m",node="{a}"}} 4.0',
        f'gateway_node_prompt_cache_cached_share{{model="m",node="{a}"}} 0.5',
        f'gateway_node_memory_budget_bytes{{model="m",node="{a}"}} 1e+06',
        f'gateway_node_memory_used_bytes{{model="m",node="{a}"}} 4000.0',
        f'gateway_node_prompt_cache_prefixes{{model="m",node="{b}"}} 1.0',
    ):
        assert line in text, (line, text)
    assert f'gateway_node_prompt_cache_hit_rate{{model="m",node="{b}"}}' not in text


def test_health_shows_this_node_summary_only() -> None:
    from gateway.status import health_facts

    facts = health_facts(PICTURE)
    assert facts["cache_stats"] == {"m": SUMMARY}
    assert "cache_stats" not in health_facts({"node": {"node_id": "x", "cache_stats": {}}})
