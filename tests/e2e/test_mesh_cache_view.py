"""The mesh-wide cache view between two real ``mesh up`` nodes on loopback, each with its own
worker of the tiny model: after a few turns on each, ``mesh status`` on either node shows the
other's prompt cache – memory tier, disk tier, prefixes, hit rate, budget – as gossip brought
it, equal to what that node reports of itself; the gateway's /metrics exports the same per
node."""

from __future__ import annotations

import sys

import httpx
import orjson
import pytest
from mesh_processes import Running, run_mesh, wait_for

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

MODEL = "model"  # the tiny model's directory name: what it is served as


def _ask(url: str, text: str) -> str:
    """One turn, to this node's own worker (its x-route says so)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 3}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.headers["x-route"]


def _status(home) -> dict:  # type: ignore[no-untyped-def]
    result = run_mesh("status", "--home", str(home), "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    return orjson.loads(result.stdout)


def _seen(home, node_id: str) -> dict | None:  # type: ignore[no-untyped-def]
    """What ``home``'s node says of ``node_id``'s cache for the model (itself or a peer)."""
    status = _status(home)
    rows = [status["node"], *status["peers"]]
    for row in rows:
        if row["node_id"] == node_id:
            return (row.get("cache_stats") or {}).get(MODEL)
    return None


def test_each_node_sees_the_other_nodes_prompt_cache(tiny_model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # --routing today: local first, so each node's turns land on its own worker.
    local = ("--model", str(tiny_model_dir), "--routing", "today")
    a = Running(tmp_path / "a", *local, "--memory-gb", "1")
    b = None
    try:
        invite = run_mesh("invite", "--home", str(a.home), "--ttl", "10m")
        assert invite.returncode == 0, invite.stderr
        token = invite.stdout.strip().splitlines()[-1]
        b = Running(tmp_path / "b", *local, "--join", token)
        a_id, b_id = _status(a.home)["node"]["node_id"], _status(b.home)["node"]["node_id"]

        # A: one turn twice (a miss, then a hit); B: one turn (a miss).
        assert [_ask(a.url, "hello there, A") for _ in range(2)] == ["local", "local"]
        assert _ask(b.url, "B's question") == "local"

        def settled(home, node_id: str, lookups: int) -> dict | None:  # type: ignore[no-untyped-def]
            seen = _seen(home, node_id)
            return seen if seen and seen["lookups"] == lookups and seen["prefixes"] else None

        # Each node's own view, then the peer's copy of it: gossip carries the same numbers.
        a_self = wait_for(lambda: settled(a.home, a_id, 2), 30, "A's own cache view")
        b_self = wait_for(lambda: settled(b.home, b_id, 1), 30, "B's own cache view")
        a_from_b = wait_for(lambda: settled(b.home, a_id, 2), 30, "A's cache seen from B")
        b_from_a = wait_for(lambda: settled(a.home, b_id, 1), 30, "B's cache seen from A")
        assert a_self["hit_rate"] == a_from_b["hit_rate"] == 0.5  # the second turn hit
        # ... all of its prompt but the last token: just under half of both turns' tokens.
        assert 0.4 < a_self["cached_share"] == a_from_b["cached_share"] < 0.5
        assert b_self["cached_share"] == b_from_a["cached_share"] == 0.0
        assert b_self["hit_rate"] == b_from_a["hit_rate"] == 0.0
        for seen in (a_self, a_from_b, b_self, b_from_a):
            assert seen["memory_bytes"] > 0 and seen["prefixes"] >= 1, seen
            assert seen["disk_bytes"] >= 0  # short prompts stay in memory (min 256 tokens)
        assert a_from_b["memory_bytes"] == a_self["memory_bytes"]
        assert a_from_b["budget_bytes"] == a_self["budget_bytes"] == 1 << 30  # --memory-gb 1
        assert b_from_a["prefixes"] == b_self["prefixes"]

        # The table a person reads: the peer's row, by its short id, with its hit rate.
        shown = run_mesh("status", "--home", str(b.home))
        assert shown.returncode == 0, shown.stderr
        lines = [line for line in shown.stdout.splitlines() if a_id[:16] in line and "%" in line]
        assert len(lines) == 1 and "50% of 2" in lines[0], shown.stdout
        assert "prompt caches" in shown.stdout

        # And B's gateway exports A's figures per node.
        metrics = httpx.get(b.url + "/metrics", timeout=10).text
        label = f'{{model="{MODEL}",node="{a_id[:16]}"}}'
        assert f"gateway_node_prompt_cache_hit_rate{label} 0.5" in metrics, metrics
        budget = [
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith(f"gateway_node_memory_budget_bytes{label} ")
        ]
        assert budget == [float(1 << 30)], metrics
    finally:
        if b is not None:
            print("---- node B ----\n" + b.stop())
        print("---- node A ----\n" + a.stop())
