"""The peer table: liveness from heartbeats and the routing order, with time passed in."""

from __future__ import annotations

from mesh.gossip import ModelAd, NodeState
from mesh.peers import PeerDropped, PeerJoined, PeerTable, PeerWentDown


def _state(node_id: str, *models: str, seq: int = 1, epoch: str = "e", **kw) -> NodeState:
    ads = [ModelAd(name=m) for m in models]
    return NodeState(node_id=node_id, seq=seq, epoch=epoch, models=ads, **kw)


def test_join_heartbeat_down_drop():
    table = PeerTable(self_id="me", down_after_s=6, drop_after_s=30)
    assert table.on_state(_state("a", "m"), now=0) == [PeerJoined("a")]
    assert table.tick(now=5) == []
    assert table.tick(now=6) == [PeerWentDown("a", "missed heartbeats")]
    assert table.candidates("m") == []  # down peers are not routed to
    assert table.tick(now=7) == []  # reported once
    # A heartbeat brings it back.
    assert table.on_state(_state("a", "m", seq=2), now=8) == [PeerJoined("a")]
    assert table.candidates("m") == ["a"]
    assert table.tick(now=38) == [PeerDropped("a", "silent")]
    assert table.peers == {}


def test_own_state_is_ignored():
    table = PeerTable(self_id="me")
    assert table.on_state(_state("me", "m"), now=0) == []
    assert table.peers == {}


def test_stale_state_ignored_new_epoch_accepted():
    table = PeerTable(self_id="me")
    table.on_state(_state("a", "m", seq=5, queue_depth=1), now=0)
    table.on_state(_state("a", "m", seq=4, queue_depth=9), now=1)
    assert table.peers["a"].state.queue_depth == 1
    # A restarted node starts counting again in a new epoch.
    table.on_state(_state("a", "m", seq=1, epoch="f", queue_depth=2), now=2)
    assert table.peers["a"].state.queue_depth == 2


def test_leave_drops_at_once():
    table = PeerTable(self_id="me")
    table.on_state(_state("a", "m"), now=0)
    assert table.on_leave("a", 1.0) == [PeerDropped("a", "left")]
    assert table.on_leave("a", 1.0) == []
    assert table.candidates("m") == []


def test_disconnect_marks_down_and_reconnect_with_same_state_revives():
    table = PeerTable(self_id="me")
    state = _state("a", "m", seq=3)
    table.on_state(state, now=0)
    assert table.on_disconnected("a") == [PeerWentDown("a", "disconnected")]
    assert table.candidates("m") == []
    # After reconnecting the peer re-sends its unchanged last state: it must count.
    assert table.on_state(state, now=1) == [PeerJoined("a")]
    assert table.candidates("m") == ["a"]


def test_candidates_only_serving_peers_least_load_first():
    table = PeerTable(self_id="me")
    table.on_state(_state("busy", "m", queue_depth=3), now=0)
    table.on_state(_state("idle", "m"), now=0)
    table.on_state(_state("other", "x"), now=0)
    assert table.candidates("m") == ["idle", "busy"]
    assert table.candidates("nope") == []
    # Requests this node has in flight there count as load too.
    for _ in range(4):
        table.begin_request("idle")
    assert table.candidates("m") == ["busy", "idle"]
    for _ in range(4):
        table.end_request("idle")
    assert table.candidates("m") == ["idle", "busy"]


def test_rtt_breaks_load_ties():
    table = PeerTable(self_id="me", rtt_bucket_s=0.02)
    table.on_state(_state("far", "m"), now=0)
    table.on_state(_state("near", "m"), now=0)
    table.on_rtt("far", 0.100)
    table.on_rtt("near", 0.001)
    assert table.candidates("m")[0] == "near"


def test_session_affinity_is_stable_and_spreads():
    table = PeerTable(self_id="me")
    for name in "abcd":
        table.on_state(_state(name, "m"), now=0)
    firsts = {table.candidates("m", f"session-{i}")[0] for i in range(40)}
    assert len(firsts) > 1  # different sessions land on different nodes
    for i in range(10):
        key = f"session-{i}"
        assert len({table.candidates("m", key)[0] for _ in range(5)}) == 1
    # Removing a node that a session does not prefer keeps its choice.
    key = "session-7"
    chosen = table.candidates("m", key)[0]
    other = next(n for n in "abcd" if n != chosen)
    table.on_leave(other, 1.0)
    assert table.candidates("m", key)[0] == chosen


def test_models_and_snapshot():
    table = PeerTable(self_id="me")
    table.on_state(_state("a", "m1", "m2", gateway_url="http://x"), now=0)
    table.on_rtt("a", 0.004)
    assert set(table.models()) == {"m1", "m2"}
    (row,) = table.snapshot(now=1.5)
    assert row["node_id"] == "a" and row["state"] == "up" and row["rtt_ms"] == 4.0
    assert row["last_seen_s"] == 1.5 and [m["name"] for m in row["models"]] == ["m1", "m2"]
    assert row["share_memory"] == 0 and row["share_memory_used"] == 0
    table.on_state(_state("b", share_memory=8_000_000_000, share_memory_used=2_000_000_000), 2.0)
    row = next(r for r in table.snapshot(now=2.0) if r["node_id"] == "b")
    assert (row["share_memory"], row["share_memory_used"]) == (8_000_000_000, 2_000_000_000)


# --------------------------------------------------------------------------- directory


def _directory():
    from gateway.testing import ScriptedUpstream
    from gateway.upstream import ModelInfo, StaticDirectory
    from mesh.directory import MeshDirectory

    local = StaticDirectory()
    local.add(ModelInfo(id="mine", context_length=512), ScriptedUpstream.of(name="local"))
    table = PeerTable(self_id="me")
    made: dict[str, ScriptedUpstream] = {}

    def upstream_for(node_id: str) -> ScriptedUpstream:
        return made.setdefault(node_id, ScriptedUpstream.of(name=node_id))

    return MeshDirectory(local=local, peers=table, upstream_for=upstream_for), table


def test_directory_lists_every_reachable_model_once():
    directory, table = _directory()
    table.on_state(_state("a", "mine", "theirs"), now=0)
    table.on_state(_state("b", "theirs"), now=0)
    models = {m.id: m for m in directory.models()}
    assert set(models) == {"mine", "theirs"}
    assert models["mine"].owned_by == "local" and models["theirs"].owned_by in {"a", "b"}


def test_directory_local_first_then_peers():
    directory, table = _directory()
    table.on_state(_state("a", "mine"), now=0)
    routes = directory.routes("mine")
    assert [(r.kind, r.peer) for r in routes] == [("local", None), ("peer", "a")]


def test_directory_peer_only_model_and_down_peer():
    directory, table = _directory()
    table.on_state(_state("a", "theirs", queue_depth=2), now=0)
    table.on_state(_state("b", "theirs"), now=0)
    assert [r.peer for r in directory.routes("theirs")] == ["b", "a"]
    assert directory.routes("theirs")[0].upstream.name == "b"
    table.on_disconnected("b")
    assert [r.peer for r in directory.routes("theirs")] == ["a"]
    assert directory.routes("nobody") == []


def test_a_model_whose_only_server_is_gone_is_remembered_for_a_while():
    table = PeerTable(self_id="me", down_after_s=6, drop_after_s=30, forget_models_after_s=60)
    table.on_state(_state("a", "m"), now=0)
    table.on_state(_state("b", "x"), now=0)
    assert table.recently_served("m", now=0) and not table.recently_served("nope", now=0)
    table.on_disconnected("a")  # down: no route, but known
    assert table.candidates("m") == [] and table.recently_served("m", now=1)
    table.on_state(_state("b", "x", seq=2), now=30)  # b keeps beating
    table.tick(now=31)  # dropped after 30 s of silence: still remembered
    assert "a" not in table.peers and table.recently_served("m", now=31)
    assert table.recently_served("m", now=90) and not table.recently_served("m", now=91)
    table.on_leave("b", now=100)  # a clean leave is remembered the same way
    assert table.recently_served("x", now=159) and not table.recently_served("x", now=160)


def test_idle_peers_share_requests_without_a_session_key():
    table = PeerTable(self_id="me")
    for name in "abc":
        table.on_state(_state(name, "m"), now=0)
    firsts = [table.candidates("m")[0] for _ in range(12)]
    assert {n: firsts.count(n) for n in "abc"} == {"a": 4, "b": 4, "c": 4}
    assert sorted(table.candidates("m")) == ["a", "b", "c"]  # every peer is still a fallback
    # Load still comes first: a busy peer is never the first choice while others are idle.
    table.begin_request("a")
    assert all(table.candidates("m")[0] != "a" for _ in range(6))
    assert all(table.candidates("m")[-1] == "a" for _ in range(6))
    # A session key keeps its one peer.
    assert len({table.candidates("m", "session-1")[0] for _ in range(6)}) == 1


def test_a_peer_keeps_its_latest_cache_digest():
    from worker.prompt_cache.digest import CacheDigest, block_hashes

    tokens = list(range(256))
    digest = CacheDigest.of_entries([tokens])
    table = PeerTable(self_id="me")
    table.on_state(NodeState(node_id="b", seq=1, cache={"m": digest.to_wire()}), now=0.0)
    record = table.peers["b"]
    assert record.digest("m") == digest
    assert record.digest("m").cached_tokens(block_hashes(tokens)) == 256
    assert record.digest("other") is None
    table.on_state(NodeState(node_id="b", seq=2, cache={"m": "garbage"}), now=1.0)
    assert record.digest("m") is None  # a bad digest is no digest, not an error
    table.on_state(NodeState(node_id="b", seq=3), now=2.0)
    assert record.digest("m") is None
