"""Routing by cached prefix and hedged first tokens over real QUIC on loopback, in-process:
a node's digest travels by gossip, the entry node routes the prompt to it and says why; a
stalled route is hedged on the next node and cancelled when that one answers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from mesh_services import quick_mesh_config, route_meta

from gateway.events import Done, TextDelta
from gateway.request import ChatRequest, Message
from gateway.router import Router
from gateway.testing import ScriptedUpstream, Stall, text_script
from gateway.upstream import ModelInfo, StaticDirectory
from mesh.identity import NodeIdentity
from mesh.routing.planner import RoutingConfig
from mesh.service import MeshService
from worker.prompt_cache.digest import CacheDigest, block_hashes
from worker.testing import wait_until

pytestmark = pytest.mark.e2e

PROMPT = list(range(2000))
REQUEST = ChatRequest(model="tiny", messages=[Message(role="user", content="hi")])


@dataclass
class TokenizingUpstream(ScriptedUpstream):
    """A local worker that also tokenizes (``prompt_blocks``) as the real one does."""

    async def prompt_blocks(self, request):
        return {"block_size": 64, "prompt_tokens": len(PROMPT), "hashes": block_hashes(PROMPT)}


@pytest.fixture
async def mesh(tmp_path):
    started: list[MeshService] = []

    async def start(name: str, worker, *, cached=False, join=None, **routing) -> MeshService:
        home: Path = tmp_path / name
        local = StaticDirectory()
        local.add(ModelInfo(id="tiny", context_length=4096), worker)
        digest = CacheDigest.of_entries([PROMPT[:1900]] if cached else [])

        async def probe():
            return {"queue_depth": 0, "in_flight": 0, "cache": {"tiny": digest.to_wire()}}

        config = quick_mesh_config(
            join_token=join, retry_backoff_s=0.05, routing=RoutingConfig(**routing)
        )
        node = MeshService(home, NodeIdentity.load_or_create(home), local, config, load_probe=probe)
        await node.start()
        started.append(node)
        return node

    yield start
    for node in reversed(started):
        await node.stop()


async def _ask(node: MeshService) -> list:
    router = Router(node.directory, retry_backoff_s=0.05)
    return [e async for e in router.stream(REQUEST, await router.aresolve(REQUEST))]


def _text(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


async def _three(mesh, b_worker, c_worker, **routing):
    entry = await mesh("a", TokenizingUpstream(scripts=[text_script("from a")], name="local"), **routing)  # fmt: skip
    token = entry.create_invite(60).encode()
    b = await mesh("b", b_worker, cached=True, join=token)
    token = entry.create_invite(60).encode()
    c = await mesh("c", c_worker, join=token)

    def ready() -> bool:
        record = entry.peers.peers.get(b.node_id)
        return c.node_id in entry.peers.peers and record is not None and bool(record.state.cache)

    await wait_until(ready, limit_s=20)
    return entry, b, c


async def test_the_request_goes_where_its_prefix_is_cached_and_says_why(mesh):
    b_worker = ScriptedUpstream(scripts=[text_script("from b")], name="local")
    c_worker = ScriptedUpstream(scripts=[text_script("from c")], name="local")
    entry, b, _ = await _three(mesh, b_worker, c_worker)
    events = await _ask(entry)
    assert _text(events) == "from b" and isinstance(events[-1], Done)
    meta = route_meta(events)
    assert meta["x-peer"] == b.node_id
    assert meta["x-mesh-route-reason"].startswith("cache 1856/2000 (")
    assert c_worker.calls == 0


async def test_today_routing_serves_locally_whatever_is_cached(mesh):
    b_worker = ScriptedUpstream(scripts=[text_script("from b")], name="local")
    c_worker = ScriptedUpstream(scripts=[text_script("from c")], name="local")
    entry, _, _ = await _three(mesh, b_worker, c_worker, mode="today")
    events = await _ask(entry)
    assert _text(events) == "from a"
    assert "x-mesh-route-reason" not in route_meta(events)


async def test_a_stalled_first_token_is_hedged_and_the_stalled_peer_stops(mesh):
    b_worker = ScriptedUpstream(scripts=[[Stall()]], name="local")
    c_worker = ScriptedUpstream(scripts=[text_script("from c")], name="local")
    entry, _, _ = await _three(mesh, b_worker, c_worker, hedge="auto", hedge_floor_s=0.3)
    events = await _ask(entry)
    meta = route_meta(events)
    assert meta["x-mesh-hedge"] == "won"
    assert meta["x-mesh-route-reason"].startswith("cache 1856/2000 (")  # the first choice, hedged
    assert _text(events) in ("from a", "from c")  # the next-best node answered
    await wait_until(lambda: b_worker.cancelled == 1, limit_s=10)  # nothing decodes for nobody
    assert entry.directory.planner.observed.hedges["won"] == 1


@dataclass
class HoldingUpstream(ScriptedUpstream):
    """A worker that says, when asked, that it holds the prompt now (its commit not yet in any
    gossiped digest): the routing-time question over the tunnel must find it."""

    held: int = 0
    questions: int = 0

    async def prefix_held(self, block_size, hashes, timeout_s):
        self.questions += 1
        assert hashes == block_hashes(PROMPT)
        return {"held_tokens": self.held, "queue_depth": 0, "in_flight": 0, "prefill_backlog": 0,
                "prefill_tok_s": 500.0}  # fmt: skip


async def test_the_next_turn_asks_the_peers_and_goes_where_the_prompt_is_held_now(mesh):
    entry = await mesh("a", TokenizingUpstream(scripts=[text_script("from a")], name="local"))
    b_worker = HoldingUpstream(scripts=[text_script("from b")], name="local")
    c_worker = HoldingUpstream(scripts=[text_script("from c")], name="local", held=1920)
    b = await mesh("b", b_worker, join=entry.create_invite(60).encode())
    c = await mesh("c", c_worker, join=entry.create_invite(60).encode())
    await wait_until(lambda: {b.node_id, c.node_id} <= entry.peers.peers.keys(), limit_s=20)
    digests = [CacheDigest.from_wire(r.state.cache.get("tiny", "64:")) for r in entry.peers.peers.values()]  # fmt: skip
    assert not any(d.hashes for d in digests)  # gossip says nothing is cached anywhere
    follow_up = ChatRequest(
        model="tiny",
        messages=[
            *REQUEST.messages,
            Message(role="assistant", content="hello"),
            Message(role="user", content="more"),
        ],
    )
    router = Router(entry.directory, retry_backoff_s=0.05)
    events = [e async for e in router.stream(follow_up, await router.aresolve(follow_up))]
    assert _text(events) == "from c"
    meta = route_meta(events)
    assert meta["x-peer"] == c.node_id
    assert meta["x-mesh-route-reason"].startswith("cache 1920/2000 (")
    assert b_worker.questions == c_worker.questions == 1  # over QUIC, one question each
    assert entry.directory.planner.observed.held_questions == 1
