"""The routing-time question: its wire form, its bounds, and the planner asking it for a
conversation's next turn (and only then), within its deadline."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import orjson
import pytest

from gateway.request import ChatRequest, Message
from gateway.testing import ScriptedUpstream, text_script
from gateway.upstream import ModelInfo, StaticDirectory
from mesh.gossip import ModelAd, NodeState
from mesh.peers import PeerTable
from mesh.routing.held import Held, parse_answer, parse_question, question
from mesh.routing.planner import RoutePlanner, RoutingConfig, continues
from worker.prompt_cache.digest import block_hashes

PROMPT = list(range(1000))
OPENING = [Message(role="system", content="agent"), Message(role="user", content="fix it")]
NEXT_TURN = ChatRequest(
    model="m",
    messages=[
        *OPENING,
        Message(role="assistant", content="done"),
        Message(role="user", content="and?"),
    ],
)
FIRST_TURN = ChatRequest(model="m", messages=OPENING)


def test_the_question_round_trips_and_anything_else_is_refused():
    assert parse_question(question("m", 64, [1, 2, 3])) == ("m", 64, [1, 2, 3])
    bad_ones = [
        b"",
        b"[]",
        b'{"model": "m"}',
        orjson.dumps({"model": 1, "block_size": 64, "hashes": []}),
        orjson.dumps({"model": "m", "block_size": 0, "hashes": []}),
        orjson.dumps({"model": "m", "block_size": 64, "hashes": [-1]}),
        b'{"model": "m", "block_size": 64, "hashes": [18446744073709551616]}',
        b'{"model": "m", "block_size": 64, "hashes": [1.5]}',
        orjson.dumps({"model": "m", "block_size": 64, "hashes": list(range(20000))}),
    ]
    for bad in bad_ones:
        with pytest.raises(ValueError):
            parse_question(bad)


def test_an_answer_is_read_field_by_field_and_a_bad_field_is_no_field():
    held = Held(900, 1, 2, 300, 125.0)
    assert parse_answer(orjson.dumps(held.to_dict())) == held
    assert parse_answer(orjson.dumps({"held_tokens": 5, "queue_depth": "x", "prefill_tok_s": -1})) == Held(5)  # fmt: skip
    assert parse_answer(b'{"held_tokens": true}') is None
    assert parse_answer(b'{"held_tokens": -3}') is None
    assert parse_answer(b"not json") is None


def test_a_turn_continues_a_conversation_when_it_carries_an_answer():
    assert continues(NEXT_TURN.messages)
    assert not continues(FIRST_TURN.messages)


@dataclass
class LocalWorker(ScriptedUpstream):
    held: int = 0

    async def prompt_blocks(self, request):
        return {"block_size": 64, "prompt_tokens": len(PROMPT), "hashes": block_hashes(PROMPT)}

    async def prefix_held(self, block_size, hashes, timeout_s):
        return {"held_tokens": self.held, "queue_depth": 0, "in_flight": 0, "prefill_backlog": 0,
                "prefill_tok_s": 200.0}  # fmt: skip


def _planner(answers: dict[str, Held | None], asked: list[str], *, silent: str | None = None):
    local = StaticDirectory()
    local.add(ModelInfo(id="m"), LocalWorker(scripts=[text_script("local")], name="local"))
    peers = PeerTable("me")
    for node in ("b", "c"):  # gossip knows nothing of any cache
        peers.on_state(NodeState(node_id=node, seq=1, models=[ModelAd(name="m")]), 10.0)
    upstreams = {n: ScriptedUpstream(scripts=[text_script(n)], name=n) for n in ("b", "c")}

    async def ask(node_id, model, block_size, hashes, timeout_s):
        asked.append(node_id)
        assert (model, block_size, hashes) == ("m", 64, block_hashes(PROMPT))
        if node_id == silent:
            await asyncio.sleep(30)  # a frozen peer: the deadline ends the wait
        return answers.get(node_id)

    config = RoutingConfig(held_question_s=0.2)
    return RoutePlanner(local, peers, upstreams.__getitem__, dict, config, lambda: 10.0, ask_held=ask)  # fmt: skip


async def test_the_next_turn_goes_where_a_node_says_it_holds_the_prompt_now():
    asked: list[str] = []
    planner = _planner({"c": Held(960, 0, 0, 0, 200.0)}, asked)
    routes = await planner.routes(NEXT_TURN)
    assert sorted(asked) == ["b", "c"]
    assert routes[0].peer == "c"
    assert routes[0].reason.startswith("cache 960/1000 (")
    assert planner.observed.held_questions == 1


async def test_a_first_turn_asks_nobody():
    asked: list[str] = []
    await _planner({"c": Held(960)}, asked).routes(FIRST_TURN)
    assert asked == []


async def test_a_silent_node_costs_the_deadline_and_no_more():
    asked: list[str] = []
    planner = _planner({"c": Held(960, 0, 0, 0, 200.0)}, asked, silent="b")
    loop = asyncio.get_running_loop()
    started = loop.time()
    routes = await planner.routes(NEXT_TURN)
    assert loop.time() - started < 2.0
    assert routes[0].peer == "c"


async def test_a_busy_holder_loses_to_a_cold_prefill_by_the_stated_rule():
    asked: list[str] = []
    # c holds 960 tokens but must first prefill 4,000 queued tokens at 200 tok/s (20 s); here
    # the whole prompt takes 5 s at the same rate.
    planner = _planner({"c": Held(960, 3, 0, 4000, 200.0)}, asked)
    routes = await planner.routes(NEXT_TURN)
    assert routes[0].peer != "c"
    assert routes[0].reason.startswith("load (c holds 960/1000 but 20.")
