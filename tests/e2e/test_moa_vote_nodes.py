"""``vote`` on a two-node mesh: once the vote is decided, the losing samples stop decoding on
both nodes – the local worker's and, through the QUIC tunnel, the peer's.

Node B asks ``model="mesh"`` to vote over 8 samples, all in one wave. Samples alternate between
two models (largest first): ``tiny``, real random-weight workers on A (a peer) and on B (local),
slowed so each of their samples would decode for seconds; and ``quick``, a scripted model on B
that answers "42" as soon as both workers are decoding their two samples each. The four quick
votes decide the vote (4 : 0, the Beta rule) while the four tiny samples are mid-decode: each
must be cancelled, not run on to ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from mesh_services import quick_mesh_config

from gateway.events import Done, Event, Meta, TextDelta
from gateway.moa import MixtureOfAgents, MoaConfig
from gateway.moa.costs import parse_votes
from gateway.request import ChatRequest, Message
from gateway.upstream import ModelInfo, StaticDirectory, Upstream
from gateway.worker_client import WorkerClient
from mesh.identity import NodeIdentity
from mesh.service import MeshService
from worker.testing import run_worker_in_thread, wait_until

STEP_S = 0.004  # one decode step of the slowed tiny model
MAX_TOKENS = 1500  # ~6 s of decoding per sample: one left running is unmistakable


def _slow_down(engine, step_s: float) -> None:
    step = engine._step

    def slow_step() -> None:
        time.sleep(step_s)
        step()

    engine._step = slow_step


class QuickOnceDecoding(Upstream):
    """Answers "42" once every engine has ``busy`` jobs decoding (a token out, still running)."""

    name = "local"

    def __init__(self, engines, busy: int) -> None:
        self.engines, self.busy, self.calls = engines, busy, 0

    def stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        self.calls += 1
        return self._answer()

    async def _answer(self) -> AsyncIterator[Event]:
        def decoding() -> bool:
            return all(
                e.stats.in_flight >= self.busy and e.stats.generated_tokens for e in self.engines
            )

        await wait_until(decoding, limit_s=30)
        yield TextDelta("42", logprob=-0.1)
        yield Done()


def _idle(stats) -> bool:
    ended = stats.completed + stats.cancelled
    return stats.submitted == ended and stats.in_flight == 0 and stats.queue_depth == 0


@pytest.fixture
async def two_nodes(tiny_model_dir, tmp_path: Path):
    """(B's directory, A's engine, B's engine, A, B, the quick upstream)."""
    with (
        run_worker_in_thread(tiny_model_dir, name="tiny") as (url_a, engine_a),
        run_worker_in_thread(tiny_model_dir, name="tiny") as (url_b, engine_b),
    ):
        for engine in (engine_a, engine_b):
            _slow_down(engine, STEP_S)
        worker_a = WorkerClient(url_a.removesuffix("/v1"), "tiny")
        worker_b = WorkerClient(url_b.removesuffix("/v1"), "tiny")
        quick = QuickOnceDecoding([engine_a, engine_b], busy=2)
        local_a, local_b = StaticDirectory(), StaticDirectory()
        local_a.add(ModelInfo(id="tiny", parameters=2), worker_a)
        local_b.add(ModelInfo(id="tiny", parameters=2), worker_b)
        local_b.add(ModelInfo(id="quick", parameters=1), quick)
        a = MeshService(
            tmp_path / "a",
            NodeIdentity.load_or_create(tmp_path / "a"),
            local_a,
            quick_mesh_config(),
        )
        await a.start()
        join = a.create_invite(60).encode()
        b = MeshService(
            tmp_path / "b",
            NodeIdentity.load_or_create(tmp_path / "b"),
            local_b,
            quick_mesh_config(join_token=join),
        )
        await b.start()
        try:
            await wait_until(lambda: len(b.directory.routes("tiny")) == 2, limit_s=15)
            yield b.directory, engine_a, engine_b, a, b, quick
        finally:
            await b.stop()
            await a.stop()
            await worker_a.aclose()
            await worker_b.aclose()


async def test_the_votes_losers_stop_decoding_on_both_nodes(two_nodes):
    directory, engine_a, engine_b, a, _b, quick = two_nodes
    config = MoaConfig(
        policy="vote",
        vote_wave=8,
        vote_confidence=0.95,
        first_token_timeout_s=30,
        total_timeout_s=60,
    )
    moa = MixtureOfAgents(directory, config)
    request = ChatRequest(
        model="mesh",
        messages=[Message(role="user", content="What is 6 * 7? Answer with the number only.")],
        max_tokens=MAX_TOKENS,
        metadata={"moa_samples": "8"},
    )
    before = {
        name: (engine.stats.submitted, engine.stats.completed, engine.stats.cancelled)
        for name, engine in (("a", engine_a), ("b", engine_b))
    }
    headers: dict[str, str] = {}
    text = []
    async for event in moa.stream(request):
        if isinstance(event, Meta):
            headers |= event.headers
        elif isinstance(event, TextDelta):
            text.append(event.text)
    assert "".join(text) == "42"
    assert headers["x-moa-decision"] == "confident" and headers["x-moa-workers"] == "8"
    assert parse_votes(headers["x-moa-votes"]) == {"42": 4}
    assert headers["x-moa-stopped"] == "4" and quick.calls == 4
    # Every tiny sample (two per node) was cancelled, none ran on to max_tokens.
    for name, engine in (("a", engine_a), ("b", engine_b)):
        await wait_until(lambda engine=engine: _idle(engine.stats), limit_s=30)
        submitted, completed, cancelled = before[name]
        assert engine.stats.submitted == submitted + 2, name
        assert engine.stats.completed == completed, f"a loser on node {name} ran to its end"
        assert engine.stats.cancelled == cancelled + 2, name
    await wait_until(lambda: a.tunnel_server.active == 0, limit_s=5)
    await asyncio.sleep(0)
