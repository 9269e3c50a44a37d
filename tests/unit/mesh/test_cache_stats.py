"""The mesh-wide cache view in gossip: a worker's /health summed up in a few numbers per model,
carried in the node state, read by older and newer peers alike."""

from __future__ import annotations

import orjson

from mesh.cache_stats import MAX_MODELS, CacheStatsAd, bounded, summarise
from mesh.gossip import NodeState, gossip_from_dict
from mesh.peers import PeerTable

HEALTH = {
    "prompt_cache": {
        "entries": 2,
        "bytes": 3000,
        "max_bytes": 9000,
        "prefixes": 5,
        "hits": 3,
        "misses": 1,
        "prompt_tokens": 1200,
        "cached_tokens": 900,
    },
    "prompt_cache_disk": {"entries": 4, "bytes": 70000, "max_bytes": 10**9},
    "memory": {"limit_bytes": 10**6, "used_bytes": 4000, "running_kv_bytes": 1000},
}


def test_a_worker_health_sums_up_to_four_numbers_and_the_budget() -> None:
    assert summarise(HEALTH) == CacheStatsAd(
        memory_bytes=3000,
        disk_bytes=70000,
        prefixes=5,
        lookups=4,
        hit_rate=0.75,
        cached_share=0.75,
        budget_bytes=10**6,
        budget_used_bytes=4000,
    )


def test_no_disk_tier_no_budget_no_lookups() -> None:
    summary = summarise({"prompt_cache": {"bytes": 10}, "prompt_cache_disk": None, "memory": None})
    assert summary == CacheStatsAd(memory_bytes=10)
    assert summary.hit_rate is None and summary.budget_bytes is None


def test_an_older_worker_or_odd_values_give_no_summary_or_zeros() -> None:
    assert summarise({"queue_depth": 0}) is None
    odd = summarise({"prompt_cache": {"bytes": "x", "hits": True, "misses": -3, "prefixes": 2.7}})
    assert odd == CacheStatsAd(prefixes=2)


def test_the_summary_travels_in_the_state_and_older_states_have_none() -> None:
    state = NodeState(node_id="a", cache_stats={"m": summarise(HEALTH)})
    assert gossip_from_dict(orjson.loads(orjson.dumps(state.model_dump()))) == state
    assert gossip_from_dict({"type": "state", "node_id": "a"}).cache_stats == {}  # older peer
    # A newer peer's extra fields, inside the summary and beside it, are ignored.
    newer = {"type": "state", "node_id": "a", "cache_stats": {"m": {"prefixes": 3, "gpu": 1}}}
    decoded = gossip_from_dict(newer)
    assert isinstance(decoded, NodeState) and decoded.cache_stats["m"].prefixes == 3


def test_an_older_node_drops_the_field_without_a_word() -> None:
    """What a node of the previous version does with ours: ``extra="ignore"``."""
    wire = NodeState(node_id="a", cache_stats={"m": CacheStatsAd(prefixes=1)}).model_dump()
    assert NodeState.model_config.get("extra") == "ignore"
    wire.pop("cache_stats")  # what it keeps
    assert gossip_from_dict(wire) == NodeState(node_id="a")


def test_a_node_gossips_a_bounded_number_of_summaries() -> None:
    many = {f"m{i:03}": CacheStatsAd() for i in range(MAX_MODELS + 10)}
    kept = bounded(many)
    assert len(kept) == MAX_MODELS and "m000" in kept
    one = len(orjson.dumps(summarise(HEALTH).model_dump()))  # type: ignore[union-attr]
    assert one < 200  # bytes: a few numbers, whatever the cache holds


def test_the_peer_table_shows_each_peer_summary() -> None:
    table = PeerTable("me")
    table.on_state(NodeState(node_id="p", cache_stats={"m": CacheStatsAd(prefixes=2)}), now=0.0)
    table.on_state(NodeState(node_id="q"), now=0.0)  # an older peer
    rows = {row["node_id"]: row for row in table.snapshot(now=1.0)}
    assert rows["p"]["cache_stats"]["m"]["prefixes"] == 2
    assert rows["q"]["cache_stats"] == {}


async def test_the_load_probe_sums_up_each_worker(tmp_path) -> None:
    """load() (the gossip's probe) turns each worker's /health into its model's summary."""
    from mesh.workers import WorkerOptions, WorkerProcess, WorkerSupervisor

    class Client:
        def __init__(self, name: str, body: dict) -> None:
            self.model_name, self.body = name, body

        async def health(self) -> dict:
            return self.body

    supervisor = WorkerSupervisor(WorkerOptions(home=tmp_path), ["m", "old"])
    for name, body in (("m", HEALTH), ("old", {"queue_depth": 0})):
        process = WorkerProcess(name, supervisor.options)
        process.client = Client(name, body)  # type: ignore[assignment]
        supervisor.processes.append(process)
    load = await supervisor.load()
    assert load["cache_stats"] == {"m": summarise(HEALTH)}  # an older worker: none
