"""RoutePlanner: where the prompt's prefix is cached, the modes, the hedge wrapper."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.hedge import HedgedUpstream
from gateway.request import ChatRequest, Message
from gateway.testing import ScriptedUpstream, text_script
from gateway.upstream import ModelInfo, StaticDirectory
from mesh.gossip import ModelAd, NodeState
from mesh.peers import PeerTable
from mesh.routing.planner import RoutePlanner, RoutingConfig, conversation_key
from mesh.routing.score import affinity
from worker.prompt_cache.digest import CacheDigest, block_hashes

PROMPT = list(range(1000))
REQUEST = ChatRequest(model="m", messages=[Message(role="user", content="hi")])


@dataclass
class TokenizingUpstream(ScriptedUpstream):
    async def prompt_blocks(self, request):
        return {"block_size": 64, "prompt_tokens": len(PROMPT), "hashes": block_hashes(PROMPT)}


def _planner(mode="cache", hedge="off", cached_on: str | None = "b", now=10.0):
    local = StaticDirectory()
    local.add(ModelInfo(id="m"), TokenizingUpstream(scripts=[text_script("local")], name="local"))
    peers = PeerTable("me")
    for node in ("b", "c"):
        cache = {"m": CacheDigest.of_entries([PROMPT[:900]]).to_wire()} if node == cached_on else {}
        state = NodeState(node_id=node, seq=1, models=[ModelAd(name="m")], cache=cache)
        peers.on_state(state, now)
    upstreams = {n: ScriptedUpstream(scripts=[text_script(n)], name=n) for n in ("b", "c")}
    config = RoutingConfig(mode=mode, hedge=hedge)
    return RoutePlanner(local, peers, upstreams.__getitem__, dict, config, lambda: now)


async def test_the_peer_holding_the_prefix_comes_first_with_its_reason():
    routes = await _planner().routes(REQUEST)
    assert routes[0].peer == "b"
    assert routes[0].reason == "cache 896/1000 (0.10s <= 1.00s elsewhere)"
    assert [r.reason for r in routes[1:]] == ["next", "next"]


async def test_with_nothing_cached_and_no_conversation_this_node_serves_and_says_why():
    bare = ChatRequest(model="m", messages=[Message(role="system", content="be brief")])
    routes = await _planner(cached_on=None).routes(bare)
    assert routes[0].kind == "local" and routes[0].reason == "local"


def _turns(first: str, count: int) -> list[ChatRequest]:
    messages = [Message(role="system", content="shared agent prompt"), Message(role="user", content=first)]  # fmt: skip
    turns = []
    for i in range(count):
        turns.append(ChatRequest(model="m", messages=list(messages)))
        messages += [Message(role="assistant", content=f"step {i}"), Message(role="tool", content="ok", tool_call_id=f"c{i}")]  # fmt: skip
    return turns


def test_a_conversation_keeps_its_key_turn_after_turn_and_others_differ():
    turns = _turns("fix the parser", 3)
    keys = {conversation_key(t.messages) for t in turns}
    assert len(keys) == 1 and None not in keys
    assert conversation_key(_turns("write the docs", 1)[0].messages) not in keys
    assert conversation_key([Message(role="system", content="x")]) is None


def test_conversations_that_open_with_the_same_words_for_different_agents_differ():
    hi = [Message(role="user", content="hi")]
    keys = {
        conversation_key(hi),
        conversation_key([Message(role="system", content="you review code"), *hi]),
        conversation_key([Message(role="system", content="you write docs"), *hi]),
    }
    assert len(keys) == 3  # the first user message alone made them one


async def test_keyless_turns_entering_anywhere_go_to_the_conversations_node():
    """No session key, nothing in any digest yet: every turn of a conversation, whichever node
    it enters (a fresh planner: no routing memory), breaks the tie for the same node – the
    tie used to go to the entry node, scattering the conversation's caches over the mesh."""
    for first in ("fix the parser", "write the docs", "port the lab", "tune the vote"):
        key = conversation_key(_turns(first, 1)[0].messages)
        for turn in _turns(first, 3):
            routes = await _planner(cached_on=None).routes(turn)
            assert (routes[0].peer or "me") == _sticky_node(key)
            assert routes[0].reason == "sticky"


async def test_the_next_turn_follows_the_prompt_before_the_digest_says_so():
    planner = _planner(cached_on=None)
    planner.observed.running["me"] = 2  # busy here: the first turn goes to a peer
    first = await planner.routes(REQUEST)
    planner.observed.running["me"] = 0
    again = await planner.routes(REQUEST)
    assert again[0].peer == first[0].peer
    assert again[0].reason.startswith("cache ")


def _session(key: str) -> ChatRequest:
    return REQUEST.model_copy(update={"session_key": key})


def _sticky_node(key: str) -> str:
    return max(("me", "b", "c"), key=lambda node: affinity(key, node))


async def test_one_sessions_first_turn_does_not_pull_other_new_sessions_after_it():
    """Sessions share a system prompt; with nothing in any digest yet, each goes to its own
    session-hash node, not to wherever the first one went (the routing memory is per session:
    it outbid the hash and piled every new session on one node)."""
    first, other = "s0", next(k for k in (f"s{i}" for i in range(1, 50)) if _sticky_node(k) != _sticky_node("s0"))  # fmt: skip
    planner = _planner(cached_on=None)
    went = await planner.routes(_session(first))
    assert (went[0].peer or "me") == _sticky_node(first)
    routes = await planner.routes(_session(other))
    assert (routes[0].peer or "me") == _sticky_node(other)
    assert routes[0].reason == "sticky"
    again = await planner.routes(_session(first))  # the session's own next turn still follows
    assert (again[0].peer or "me") == _sticky_node(first)


async def test_modes_today_and_round_robin():
    assert await _planner(mode="today").routes(REQUEST) == []
    planner = _planner(mode="round-robin")
    firsts = [(await planner.routes(REQUEST))[0] for _ in range(3)]
    assert {r.peer or "me" for r in firsts} == {"me", "b", "c"}


async def test_hedge_auto_wraps_the_first_route_on_the_second():
    routes = await _planner(hedge="auto").routes(REQUEST)
    hedged = routes[0].upstream
    assert isinstance(hedged, HedgedUpstream)
    assert hedged.delay_s >= 0.5  # the floor
    assert hedged.allow()  # the backup is idle
    hedged.on_hedge("started")
    hedged.on_hedge("started")
    assert not hedged.allow()  # at most max_hedges at once


async def test_stream_through_a_planned_route_times_its_first_token():
    planner = _planner()
    routes = await planner.routes(REQUEST)
    events = [e async for e in routes[0].upstream.stream(REQUEST)]
    assert events
    assert planner.observed.ttft_s("b") is not None
    assert planner.observed.running["b"] == 0


def test_all_idle_asks_every_node_serving_the_model_without_turning_the_round_robin():
    planner = _planner(cached_on=None)
    before = planner.peers._turn
    assert planner.all_idle("m")  # nothing running anywhere, no load heard
    assert planner.peers._turn == before  # the peers' round robin did not move
    planner.observed.running["c"] = 1
    assert not planner.all_idle("m")
    assert not planner.all_idle("other")  # nobody serves it: not an idle mesh
