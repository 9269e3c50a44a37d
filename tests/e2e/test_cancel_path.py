"""A client that leaves stops the generation, every time, within one decode step plus one RTT
(plus scheduling slack on a shared 2-core machine).

The worker is real (tiny MLX model, real uvicorn in its own thread, decode slowed to a few ms
per step) and its engine's counters say whether a job is still running. First the gateway's
``WorkerClient`` alone, cancelled twice in a row; then the whole forwarded path in one process:
an HTTP client streams from B's gateway (real uvicorn), B forwards over real QUIC to A, A's
tunnel server runs the request on the worker; the client leaves at different moments, 100 times.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from pathlib import Path

import orjson
import pytest
import uvicorn
from mesh_services import quick_mesh_config

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.events import TextDelta
from gateway.request import ChatRequest, Message
from gateway.upstream import ModelInfo, StaticDirectory
from gateway.worker_client import WorkerClient
from mesh.identity import NodeIdentity
from mesh.service import MeshConfig, MeshService
from mesh.tunnel.config import TunnelConfig
from mesh.tunnel.frames import ErrorCode
from worker.serve.net import bind_socket, server_limits
from worker.testing import run_worker_in_thread, wait_until

TRIES = 100
STEP_S = 0.004  # one decode step of the slowed tiny model
MAX_TOKENS = 1500  # ~6 s of decoding: a missed cancel is unmistakable
# One decode step plus one loopback RTT is a few ms; the rest is slack for a loaded machine.
STOP_WITHIN_S = 0.5


def _config(**kw) -> MeshConfig:
    tunnel = TunnelConfig(ping_interval=0.5, ping_timeout=3.0, handshake_timeout=3.0)
    return quick_mesh_config(**({"retry_backoff_s": 0.05, "tunnel": tunnel} | kw))


def _slow_down(engine, step_s: float) -> None:
    """Each decode step takes at least ``step_s`` (the owner thread sleeps before it)."""
    step = engine._step

    def slow_step() -> None:
        time.sleep(step_s)
        step()

    engine._step = slow_step


@pytest.fixture(scope="module")
def slow_worker(tiny_model_dir):
    """(base URL, engine) of a real worker whose decode steps take ``STEP_S``."""
    with run_worker_in_thread(tiny_model_dir, name="tiny") as (worker_url, engine):
        _slow_down(engine, STEP_S)
        yield worker_url.removesuffix("/v1"), engine


def _idle(stats) -> bool:
    """Every job the engine was given has ended, none is running or queued."""
    ended = stats.completed + stats.cancelled
    return stats.submitted == ended and stats.in_flight == 0 and stats.queue_depth == 0


async def _stopped_within(stats, bound_s: float) -> bool:
    """Whether the engine is idle within ``bound_s``; if not, wait out the runaway job."""
    deadline = time.monotonic() + bound_s
    while not _idle(stats):
        if time.monotonic() > deadline:
            await wait_until(lambda: _idle(stats), limit_s=30)
            return False
        await asyncio.sleep(0.002)
    return True


async def test_worker_client_cancelled_twice_still_stops_the_worker(slow_worker):
    """A consumer cancelled again while the client closes its response (a connection lost
    while the peer cancels, a MoA loser cancelled then closed): httpx then leaves the
    connection open (encode/httpcore#1115) unless the client guards its close."""
    url, engine = slow_worker
    worker = WorkerClient(url, "tiny")
    request = ChatRequest(
        model="tiny", messages=[Message(role="user", content="hi")], max_tokens=MAX_TOKENS
    )
    missed = []
    try:
        for i in range(24):
            first = asyncio.Event()

            async def consume(first: asyncio.Event) -> None:
                async for event in worker.stream(request):
                    if isinstance(event, TextDelta):
                        first.set()

            task = asyncio.create_task(consume(first))
            await first.wait()
            task.cancel()
            for _ in range(i % 4):  # the second cancel lands somewhere in the close
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.wait([task])
            if not await _stopped_within(engine.stats, STOP_WITHIN_S):
                missed.append(i)
    finally:
        await worker.aclose()
    assert not missed, f"the worker kept generating after tries {missed}"


@pytest.fixture
async def forwarded(slow_worker, tmp_path: Path):
    """(gateway URL on B, A's engine, A, B): B has no model; A serves ``tiny`` on a real worker."""
    url, engine = slow_worker
    worker = WorkerClient(url, "tiny")
    local = StaticDirectory()
    local.add(ModelInfo(id="tiny"), worker)
    a = MeshService(tmp_path / "a", NodeIdentity.load_or_create(tmp_path / "a"), local, _config())
    await a.start()
    b_home = tmp_path / "b"
    join = a.create_invite(60).encode()
    b = MeshService(
        b_home, NodeIdentity.load_or_create(b_home), StaticDirectory(), _config(join_token=join)
    )
    await b.start()
    sock = bind_socket("127.0.0.1", 0)
    app = create_app(b.directory, GatewayConfig(retry_backoff_ms=50))
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", **server_limits())
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await wait_until(lambda: server.started and "tiny" in b.peers.models(), limit_s=15)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine, a, b
    finally:
        server.should_exit = True
        await serving
        sock.close()
        await b.stop()
        await a.stop()
        await worker.aclose()


async def _leave(url: str, moment: str, delay_s: float) -> None:
    """One streamed request that the client abandons: ``sent`` (``delay_s`` after sending, mostly
    before the peer's worker has produced anything), ``headers`` (once the response started) or
    ``token`` (after the first content chunk). A raw socket, closed for sure: an httpx client
    cancelled while it closes its response keeps the socket open (encode/httpcore#1115), and a
    client that is still connected has not left."""
    body = orjson.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": MAX_TOKENS,
            "stream": True,
        }
    )
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    try:
        if moment == "sent":
            await asyncio.sleep(delay_s)
            return
        seen = b""
        wanted = b"\r\n\r\n" if moment == "headers" else b'"content"'
        while wanted not in seen:
            chunk = await reader.read(65536)
            assert chunk, seen
            seen += chunk
        assert seen.startswith(b"HTTP/1.1 200"), seen
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def test_client_leaving_stops_the_peers_generation_every_time(forwarded):
    url, engine, a, b = forwarded
    stats = engine.stats
    completed = stats.completed
    moments = ["token", "sent", "headers", "drop"]
    rng = random.Random(11)
    missed: list[str] = []
    for i in range(TRIES):
        moment = moments[i % len(moments)]
        submitted = stats.submitted
        if moment == "drop":
            # The client leaves, then the requester's link dies while the peer is still
            # cancelling: a second cancellation must not undo the first.
            await _leave(url, "token", 0.0)
            await asyncio.sleep(rng.uniform(0.0, 0.004))
            b.links[a.node_id].close(ErrorCode.NO_ERROR, "test: link dropped")
        else:
            await _leave(url, moment, rng.uniform(0.0, 0.03))
        if moment != "sent":  # the job had started: it is running now or was just cancelled
            assert stats.submitted > submitted
        if not await _stopped_within(stats, STOP_WITHIN_S):
            missed.append(f"{i}:{moment}")
        await wait_until(lambda: a.tunnel_server.active == 0, limit_s=5)
        if moment == "drop":  # both sides redial: wait until the tie-break has settled
            for _ in range(2):
                await wait_until(
                    lambda: a.node_id in b.links and "tiny" in b.peers.models(), limit_s=10
                )
                await asyncio.sleep(0.3)
    await asyncio.sleep(0.3)  # a job that reached the worker after its client left ends too
    assert await _stopped_within(stats, STOP_WITHIN_S)
    assert not missed, f"{len(missed)}/{TRIES} cancels missed: {missed}"
    assert stats.completed == completed  # no abandoned request ran to max_tokens
