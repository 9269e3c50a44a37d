"""QUIC tunnel on loopback: two real endpoints, real aioquic, optional chaos proxy between."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import pytest
from aioquic.asyncio import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, QuicEvent

from gateway.events import Done, TextDelta
from gateway.request import ChatRequest, Message
from gateway.testing import ScriptedUpstream, Sleep, Stall
from gateway.upstream import ModelInfo, StaticDirectory
from lab.chaos import ChaosProxy
from mesh.errors import (
    AuthFailed,
    ClosedError,
    ConnectError,
    ConnectionLost,
    DuplicateNodeError,
    IncompleteResponse,
    MeshError,
    ProtocolViolation,
    StreamReset,
)
from mesh.identity import NodeIdentity
from mesh.peer_upstream import PeerUpstream
from mesh.tunnel.config import TunnelConfig
from mesh.tunnel.connection import PeerConnection
from mesh.tunnel.endpoint import TunnelEndpoint
from mesh.tunnel.frames import (
    Body,
    BodyEnd,
    Control,
    Data,
    End,
    ErrorCode,
    RequestHead,
    ResponseHead,
)
from mesh.tunnel.stream import TunnelStream
from mesh.tunnel_server import TunnelServer

FAST = TunnelConfig(ping_interval=0.2, ping_timeout=1.0, handshake_timeout=3.0, close_grace=0.5)
Handler = Callable[[TunnelStream], Awaitable[None]]


async def echo_handler(stream: TunnelStream) -> None:
    """Answers with the request path and body, upper-cased."""
    head = await stream.recv()
    assert isinstance(head, RequestHead)
    body = b"".join([f.data async for f in stream if isinstance(f, Body)])
    await stream.send(ResponseHead(status=200, headers={"x-path": head.path}))
    await stream.send(Data(body.upper()))
    await stream.send(End())


def serve_with(endpoint: TunnelEndpoint, handler: Handler, authenticate: bool = True) -> None:
    async def on_connection(conn: PeerConnection) -> None:
        conn.on_stream = handler
        if authenticate:
            conn.mark_authenticated()

    endpoint.on_connection = on_connection


@pytest.fixture
async def pair() -> AsyncIterator[tuple[TunnelEndpoint, TunnelEndpoint]]:
    a = TunnelEndpoint(NodeIdentity.generate(), "127.0.0.1", 0, config=FAST)
    b = TunnelEndpoint(NodeIdentity.generate(), "127.0.0.1", 0, config=FAST)
    serve_with(a, echo_handler)
    serve_with(b, echo_handler)
    await a.start()
    await b.start()
    yield a, b
    await a.close()
    await b.close()


async def dial(a: TunnelEndpoint, b: TunnelEndpoint, port: int | None = None) -> PeerConnection:
    return await a.connect(
        "127.0.0.1", port or b.port, expected_fingerprint=b.identity.cert_fingerprint
    )


async def request(conn: PeerConnection, path: str, body: bytes = b"") -> list:
    stream = await conn.open_stream()
    async with stream:
        await stream.send(RequestHead(id=path, path=path, deadline=5.0))
        if body:
            await stream.send(Body(body))
        await stream.send(BodyEnd())
        return [frame async for frame in stream]


async def eventually(predicate: Callable[[], bool], limit: float = 5.0) -> None:
    """Poll a condition that the code under test makes true asynchronously."""
    async with asyncio.timeout(limit):
        while not predicate():  # noqa: ASYNC110 - state of other objects, no event to await
            await asyncio.sleep(0.01)


async def test_request_and_response_in_both_directions(pair) -> None:
    a, b = pair
    conn = await dial(a, b)
    assert conn.peer_node_id == b.identity.node_id
    frames = await request(conn, "/a-to-b", b"hello")
    assert frames == [
        ResponseHead(status=200, headers={"x-path": "/a-to-b"}),
        Data(b"HELLO"),
        End(),
    ]
    # the same connection, opened by the other side (mutual TLS: b knows a's node id)
    await eventually(lambda: b.connection_for(a.identity.node_id) is not None)
    back = b.connection_for(a.identity.node_id)
    assert back is not None and not back.is_client
    assert back.peer_public_key == a.identity.public_key_bytes
    frames = await request(back, "/b-to-a", b"world")
    assert frames[1] == Data(b"WORLD") and frames[-1] == End()
    assert len(a.connections) == len(b.connections) == 1


async def test_connect_reuses_the_live_connection(pair) -> None:
    a, b = pair
    first = await dial(a, b)
    again = await a.connect("127.0.0.1", b.port, expected_node_id=b.identity.node_id)
    assert again is first


async def test_control_stream_both_ways(pair) -> None:
    a, b = pair
    got: asyncio.Queue = asyncio.Queue()

    async def on_connection(conn: PeerConnection) -> None:
        assert conn.control is not None
        await got.put(await conn.control.recv())
        await conn.control.send(Control(kind="welcome", body={"to": conn.peer_node_id}))

    b.on_connection = on_connection
    conn = await dial(a, b)
    assert conn.control is not None
    await conn.control.send(Control(kind="hello", body={"n": 1}))
    assert await got.get() == Control(kind="hello", body={"n": 1})
    assert await conn.control.recv() == Control(kind="welcome", body={"to": a.identity.node_id})


async def test_wrong_fingerprint_is_refused(pair) -> None:
    a, b = pair
    other = NodeIdentity.generate()
    with pytest.raises(AuthFailed, match="pin mismatch"):
        await a.connect("127.0.0.1", b.port, expected_fingerprint=other.cert_fingerprint)
    with pytest.raises(AuthFailed, match="node id mismatch"):
        await a.connect("127.0.0.1", b.port, expected_node_id=other.node_id)
    assert a.connections == []


async def test_pin_is_required(pair) -> None:
    a, b = pair
    with pytest.raises(ValueError):
        await a.connect("127.0.0.1", b.port)


async def test_duplicate_node_id_is_refused_on_both_sides(pair) -> None:
    _, b = pair
    clone = TunnelEndpoint(b.identity, "127.0.0.1", 0, config=FAST)  # a copied home dir
    seen: list[DuplicateNodeError] = []
    b.on_duplicate_node = seen.append
    await clone.start()
    try:
        with pytest.raises(DuplicateNodeError, match="copied home dir"):
            await clone.connect("127.0.0.1", b.port, expected_node_id=b.identity.node_id)
        await eventually(lambda: bool(seen))
        assert b.connections == []
    finally:
        await clone.close()


async def test_unreachable_peer_is_a_connect_error() -> None:
    a = TunnelEndpoint(
        NodeIdentity.generate(), "127.0.0.1", 0, config=TunnelConfig(handshake_timeout=0.5)
    )
    await a.start()
    silent = ChaosProxy(("127.0.0.1", 9), seed=0)
    await silent.start()
    silent.set_faults(blackhole=True)
    try:
        with pytest.raises(ConnectError, match="timed out"):
            await a.connect("127.0.0.1", silent.port, expected_node_id="00" * 32)
    finally:
        await a.close()
        await silent.close()


async def test_peer_reset_reaches_the_reader(pair) -> None:
    a, b = pair

    async def failing(stream: TunnelStream) -> None:
        await stream.recv()
        await stream.send(ResponseHead(status=200))
        stream.reset(ErrorCode.UPSTREAM_FAILED)

    serve_with(b, failing)
    conn = await dial(a, b)
    stream = await conn.open_stream()
    await stream.send(RequestHead(id="1", path="/"))
    await stream.send(BodyEnd())
    with pytest.raises(StreamReset) as info:
        async for _ in stream:
            pass
    assert info.value.code == ErrorCode.UPSTREAM_FAILED


async def test_requester_cancel_reaches_the_handler(pair) -> None:
    a, b = pair
    outcome: asyncio.Future = asyncio.get_running_loop().create_future()

    async def waiting(stream: TunnelStream) -> None:
        await stream.recv()
        try:
            await stream.recv()  # the rest of the body never comes
        except StreamReset as exc:
            outcome.set_result(exc.code)
            raise

    serve_with(b, waiting)
    conn = await dial(a, b)
    stream = await conn.open_stream()
    async with stream:
        await stream.send(RequestHead(id="1", path="/"))
        await asyncio.sleep(0.05)
    assert await asyncio.wait_for(outcome, 5) == ErrorCode.CANCELLED


async def test_eof_without_end_is_a_failure(pair) -> None:
    a, b = pair

    async def truncating(stream: TunnelStream) -> None:
        await stream.recv()
        await stream.send(ResponseHead(status=200))
        await stream.send(Data(b"partial"))
        stream.finish()  # FIN, but no End

    serve_with(b, truncating)
    conn = await dial(a, b)
    with pytest.raises(IncompleteResponse):
        await request(conn, "/")


async def test_handler_that_returns_without_end_resets(pair) -> None:
    a, b = pair

    async def forgetful(stream: TunnelStream) -> None:
        await stream.recv()

    serve_with(b, forgetful)
    conn = await dial(a, b)
    with pytest.raises(StreamReset) as info:
        await request(conn, "/")
    assert info.value.code == ErrorCode.INTERNAL


async def test_protocol_violation_resets_the_stream(pair) -> None:
    a, b = pair
    conn = await dial(a, b)
    stream = await conn.open_stream()
    await stream.send(Data(b"no head first"))
    with pytest.raises(StreamReset) as info:
        await stream.recv()
    assert info.value.code == ErrorCode.PROTOCOL


async def test_streams_are_held_until_authenticated(pair) -> None:
    a, b = pair
    server_side: list[PeerConnection] = []

    async def on_connection(conn: PeerConnection) -> None:
        conn.on_stream = echo_handler
        server_side.append(conn)

    b.on_connection = on_connection
    conn = await dial(a, b)
    pending = asyncio.create_task(request(conn, "/held", b"x"))
    await eventually(lambda: bool(server_side) and len(server_side[0]._held) == 1)
    assert not pending.done()
    server_side[0].mark_authenticated()
    frames = await asyncio.wait_for(pending, 5)
    assert frames[-1] == End()


async def test_dead_peer_is_detected_quickly(pair) -> None:
    a, b = pair
    proxy = ChaosProxy(("127.0.0.1", b.port), seed=1)
    await proxy.start()

    async def slow(stream: TunnelStream) -> None:
        await stream.recv()
        await asyncio.sleep(60)

    serve_with(b, slow)
    try:
        conn = await dial(a, b, proxy.port)
        stream = await conn.open_stream()
        await stream.send(RequestHead(id="1", path="/"))
        await stream.send(BodyEnd())
        proxy.set_faults(blackhole=True)  # the peer vanishes without a word
        started = asyncio.get_running_loop().time()
        with pytest.raises(ConnectionLost) as info:
            await asyncio.wait_for(stream.recv(), 10)
        assert info.value.code == ErrorCode.PING_TIMEOUT
        elapsed = asyncio.get_running_loop().time() - started
        assert elapsed < FAST.ping_interval + FAST.ping_timeout + 2.0
        assert conn.is_closed and conn.closed.is_set()
        assert a.connection_for(b.identity.node_id) is None
        with pytest.raises(ConnectionLost):
            await conn.open_stream()
    finally:
        await proxy.close()


async def test_large_response_survives_20_percent_loss(pair) -> None:
    a, b = pair
    payload = bytes(range(256)) * 400  # 100 KiB

    async def big(stream: TunnelStream) -> None:
        await stream.recv()
        await stream.recv()
        await stream.send(ResponseHead(status=200))
        for i in range(0, len(payload), 8192):
            await stream.send(Data(payload[i : i + 8192]))
        await stream.send(End())

    serve_with(b, big)
    # under loss a live peer may be briefly silent: don't let keep-alive race the transfer
    a.config = b.config = replace(FAST, ping_timeout=5.0)
    proxy = ChaosProxy(("127.0.0.1", b.port), seed=7)
    await proxy.start()
    try:
        conn = await dial(a, b, proxy.port)
        proxy.set_faults(loss=0.2)
        frames = await asyncio.wait_for(request(conn, "/big"), 60)
        assert b"".join(f.data for f in frames if isinstance(f, Data)) == payload
        assert frames[-1] == End()
        assert proxy.stats["downstream"].dropped > 0
    finally:
        await proxy.close()


async def test_deferred_tokens_share_datagrams_and_arrive_whole_and_in_order(pair) -> None:
    a, b = pair
    tokens = [b"token %d" % i for i in range(200)]

    async def streaming(stream: TunnelStream) -> None:
        await stream.recv()
        await stream.recv()
        await stream.send(ResponseHead(status=200), defer=True)
        await stream.send(Data(tokens[0]))  # the first token: at once, the head with it
        for token in tokens[1:]:
            await stream.send(Data(token), defer=True)
            await asyncio.sleep(0)  # one token per loop turn, like an engine
        await stream.send(End())

    serve_with(b, streaming)
    conn = await dial(a, b)
    await eventually(lambda: b.connection_for(a.identity.node_id) is not None)
    server = b.connection_for(a.identity.node_id)
    assert server is not None
    packets_before = server._quic._packet_number
    frames = await request(conn, "/tokens")
    assert frames == [ResponseHead(status=200), *(Data(t) for t in tokens), End()]
    # One datagram per token would be 200 and more; held tokens leave together.
    assert server._quic._packet_number - packets_before < 100


async def test_a_held_frame_leaves_with_the_next_urgent_one_or_after_flush_delay(pair) -> None:
    a, b = pair
    # Held until an urgent frame of its stream takes it along: aioquic's own sends (ACKs,
    # pings) and other streams' urgent frames leave it held.
    a.config = b.config = replace(FAST, flush_delay=30.0)
    head_seen, held, go = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def holding(stream: TunnelStream) -> None:
        head = await stream.recv()
        await stream.recv()
        await stream.send(ResponseHead(status=200))
        if head.path == "/echo":
            await stream.send(Data(b"echo"))
            await stream.send(End())
            return
        # A connection quiet for flush_delay holds nothing: this one leaves at once...
        await stream.send(Data(b"first"), defer=True)
        await head_seen.wait()
        await stream.send(Data(b"held"), defer=True)  # ...this one waits for flush_delay
        held.set()
        await go.wait()
        await stream.send(End())

    serve_with(b, holding)
    conn = await dial(a, b)
    stream = await conn.open_stream()
    async with stream:
        await stream.send(RequestHead(id="1", path="/"))
        await stream.send(BodyEnd())
        assert await stream.recv() == ResponseHead(status=200)
        assert await asyncio.wait_for(stream.recv(), 5) == Data(b"first")
        head_seen.set()
        await held.wait()
        other = await asyncio.wait_for(request(conn, "/echo"), 5)  # urgent, on another stream
        assert other == [ResponseHead(status=200), Data(b"echo"), End()]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(stream.recv(), 0.3)  # still held
        go.set()
        assert [f async for f in stream] == [Data(b"held"), End()]

    a.config = b.config = FAST  # a fresh connection: a held frame goes by itself
    shown: asyncio.Future = asyncio.get_running_loop().create_future()

    async def trickle(stream: TunnelStream) -> None:
        await stream.recv()
        await stream.recv()
        await stream.send(ResponseHead(status=200))
        await stream.send(Data(b"first"))
        await stream.send(Data(b"second"), defer=True)
        await shown
        await stream.send(End())

    serve_with(b, trickle)
    conn.close()
    await eventually(lambda: not a.connections and not b.connections)
    conn = await dial(a, b)
    stream = await conn.open_stream()
    async with stream:
        await stream.send(RequestHead(id="2", path="/"))
        await stream.send(BodyEnd())
        got = [await asyncio.wait_for(stream.recv(), 5) for _ in range(3)]
        assert got == [ResponseHead(status=200), Data(b"first"), Data(b"second")]
        shown.set_result(None)
        assert await stream.recv() == End()


async def test_a_deferred_end_goes_at_once_alone_and_with_the_flush_on_a_busy_connection(
    pair,
) -> None:
    a, b = pair
    a.config = b.config = replace(FAST, flush_delay=30.0)
    first_seen, other_held, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def answering(stream: TunnelStream) -> None:
        head = await stream.recv()
        await stream.recv()
        await stream.send(ResponseHead(status=200))
        if head.path == "/busy":  # a stream whose tokens wait for the flush
            await stream.send(Data(b"first"), defer=True)  # a quiet connection: goes at once
            await first_seen.wait()
            await stream.send(Data(b"held"), defer=True)  # held for 30 s
            other_held.set()
            await release.wait()
            await stream.send(Data(b"z" * (20 * 1024)), defer=True)  # FLUSH_BYTES: a flush
            await stream.send(End())
            return
        await stream.send(Data(head.path.encode()))
        await stream.send(End(), defer=True)

    serve_with(b, answering)
    conn = await dial(a, b)
    # Nothing else waits for a flush: the deferred End goes at once (flush_delay is 30 s).
    alone = await asyncio.wait_for(request(conn, "/alone"), 5)
    assert alone == [ResponseHead(status=200), Data(b"/alone"), End()]
    busy = await conn.open_stream()
    await busy.send(RequestHead(id="1", path="/busy"))
    await busy.send(BodyEnd())
    assert await asyncio.wait_for(busy.recv(), 5) == ResponseHead(status=200)
    assert await asyncio.wait_for(busy.recv(), 5) == Data(b"first")
    first_seen.set()
    await asyncio.wait_for(other_held.wait(), 5)
    stream = await conn.open_stream()
    async with stream:
        await stream.send(RequestHead(id="2", path="/shared"))
        await stream.send(BodyEnd())
        assert await asyncio.wait_for(stream.recv(), 5) == ResponseHead(status=200)
        assert await asyncio.wait_for(stream.recv(), 5) == Data(b"/shared")
        with pytest.raises(TimeoutError):  # its End waits with the other stream's token
            await asyncio.wait_for(stream.recv(), 0.3)
        release.set()  # the other stream's writes fill a flush: the End leaves with them
        assert await asyncio.wait_for(stream.recv(), 5) == End()
    async with busy:
        rest = [frame async for frame in busy]
    assert rest[0] == Data(b"held") and rest[-1] == End()


async def test_a_held_fin_leaves_with_the_next_urgent_datagram(pair) -> None:
    """The requester's FIN after a response's End is held for the flush; the next request
    takes it along instead of a datagram of its own a moment later."""
    a, b = pair
    a.config = b.config = replace(FAST, flush_delay=30.0)
    conn = await dial(a, b)
    await eventually(lambda: b.connection_for(a.identity.node_id) is not None)
    server = b.connection_for(a.identity.node_id)
    assert server is not None
    await request(conn, "/1")  # a quiet connection: its FIN goes with the first flush at once
    await eventually(lambda: server.active_streams == 0)
    await request(conn, "/2")  # this FIN is held: the last flush was just now
    await asyncio.sleep(0.2)
    assert server.active_streams == 1  # stream 2 waits for the requester's FIN
    await request(conn, "/3")  # urgent: stream 2's FIN rides along (stream 3's is held)
    await eventually(lambda: server.active_streams == 1 and 8 not in server._streams)


async def test_before_flush_writes_at_the_flush_and_a_reset_drops_it(pair) -> None:
    a, b = pair
    a.config = b.config = replace(FAST, flush_delay=30.0)
    warm_seen, registered = asyncio.Event(), asyncio.Event()
    called: list[str] = []

    async def gathering(stream: TunnelStream) -> None:
        head = await stream.recv()
        await stream.recv()
        await stream.send(ResponseHead(status=200))
        # The first, deferred on a quiet connection, goes at once – and that flush makes the
        # next one 30 s away; the second goes at once, being urgent.
        await stream.send(Data(b"warm"), defer=head.path == "/reset")
        await warm_seen.wait()

        def write() -> None:
            called.append(head.path)
            stream.send_held(Data(b"gathered"))

        stream.before_flush(write)  # held: flush_delay is 30 s
        registered.set()
        if head.path == "/reset":
            await stream.wait_broken()
            return
        await stream.send(Data(b"z" * (20 * 1024)), defer=True)  # FLUSH_BYTES: a flush now
        await stream.send(End())

    serve_with(b, gathering)
    conn = await dial(a, b)
    for path in ("/reset", "/flush"):
        warm_seen.clear()
        registered.clear()
        stream = await conn.open_stream()
        async with stream:  # /reset leaves early: reset with CANCELLED
            await stream.send(RequestHead(id=path, path=path))
            await stream.send(BodyEnd())
            assert await asyncio.wait_for(stream.recv(), 5) == ResponseHead(status=200)
            assert await asyncio.wait_for(stream.recv(), 5) == Data(b"warm")
            warm_seen.set()
            await asyncio.wait_for(registered.wait(), 5)
            if path == "/flush":
                rest = [frame async for frame in stream]
                assert rest == [Data(b"z" * (20 * 1024)), Data(b"gathered"), End()]
    assert called == ["/flush"]  # the reset stream's callback was dropped, never called
    assert not conn.is_closed


async def test_a_reset_drops_held_frames_and_the_connection_goes_on(pair) -> None:
    a, b = pair
    a.config = b.config = replace(FAST, flush_delay=30.0)
    broken: asyncio.Future = asyncio.get_running_loop().create_future()
    warm_seen, held = asyncio.Event(), asyncio.Event()

    async def held_then_reset(stream: TunnelStream) -> None:
        head = await stream.recv()
        await stream.recv()
        if head.path == "/echo":
            await stream.send(ResponseHead(status=200))
            await stream.send(End())
            return
        await stream.send(ResponseHead(status=200))
        await stream.send(Data(b"warm"), defer=True)  # a quiet connection sends it at once
        await warm_seen.wait()
        await stream.send(Data(b"never seen"), defer=True)  # held: flush_delay is 30 s
        held.set()
        broken.set_result(await stream.wait_broken())
        await stream.send(End())  # raises: the requester stopped the stream

    serve_with(b, held_then_reset)
    conn = await dial(a, b)
    stream = await conn.open_stream()
    async with stream:  # left early: reset with CANCELLED
        await stream.send(RequestHead(id="1", path="/hold"))
        await stream.send(BodyEnd())
        assert await stream.recv() == ResponseHead(status=200)
        assert await asyncio.wait_for(stream.recv(), 5) == Data(b"warm")
        warm_seen.set()
        await asyncio.wait_for(held.wait(), 5)
    error = await asyncio.wait_for(broken, 5)
    assert isinstance(error, StreamReset) and error.code == ErrorCode.CANCELLED
    frames = await asyncio.wait_for(request(conn, "/echo"), 5)
    assert frames == [ResponseHead(status=200), End()]
    assert not conn.is_closed


async def test_a_relayed_first_token_is_never_held_and_cancel_still_reaches_the_engine(
    pair,
) -> None:
    a, b = pair
    a.config = b.config = replace(FAST, flush_delay=30.0)
    # A "prefill" first: the ACK of the request (which flushes whatever is held) is long gone.
    engine = ScriptedUpstream.of(Sleep(0.2), TextDelta("first"), TextDelta("second"), Stall())
    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), engine)
    serve_with(b, TunnelServer(directory).handle)
    conn = await dial(a, b)

    async def connect() -> PeerConnection:
        return conn

    peer = PeerUpstream(name=b.identity.node_id, connect=connect)
    request = ChatRequest(model="m", messages=[Message(role="user", content="x")])
    events = peer.stream(request)
    async with contextlib.aclosing(events):
        async with asyncio.timeout(5):  # far below flush_delay: the first token went at once
            while not isinstance(event := await anext(events), TextDelta):
                pass
        assert event == TextDelta("first")
    await eventually(lambda: engine.cancelled == 1)


async def test_a_free_engines_tokens_are_relayed_merged_whole_and_in_order(pair) -> None:
    a, b = pair
    tokens = [f" t{i}" for i in range(300)]
    steps: list = []
    for token in tokens:
        steps += [Sleep(0), TextDelta(token)]  # one token per loop turn: faster than flushes
    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), ScriptedUpstream.of(*steps, Done("stop")))
    serve_with(b, TunnelServer(directory).handle)
    conn = await dial(a, b)

    async def connect() -> PeerConnection:
        return conn

    peer = PeerUpstream(name=b.identity.node_id, connect=connect)
    request = ChatRequest(model="m", messages=[Message(role="user", content="x")])
    events = [event async for event in peer.stream(request)]
    deltas = [e for e in events if isinstance(e, TextDelta)]
    assert "".join(d.text for d in deltas) == "".join(tokens)
    assert deltas[0] == TextDelta(tokens[0])  # the first token alone, at once
    assert len(deltas) < len(tokens) // 4  # the rest shared events, not just datagrams
    assert events[-1] == Done("stop")


async def test_500_concurrent_streams_leave_no_state(pair) -> None:
    a, b = pair
    conn = await dial(a, b)
    results = await asyncio.gather(*(request(conn, f"/{i}", str(i).encode()) for i in range(500)))
    for i, frames in enumerate(results):
        assert frames[1] == Data(str(i).encode()) and frames[-1] == End()
    server = b.connection_for(a.identity.node_id)
    assert server is not None
    await eventually(lambda: conn.active_streams == 0 and server.active_streams == 0)
    assert not server._held and not server._tasks
    # aioquic discards its own stream state once both sides' FINs are acknowledged
    await eventually(lambda: len(conn._quic._streams) <= 1 and len(server._quic._streams) <= 1)


async def test_slow_reader_bounds_the_sender(pair) -> None:
    a, b = pair
    window = FAST.stream_window
    chunk = 16 * 1024
    total = 8 * window
    served: list[TunnelStream] = []

    async def flood(stream: TunnelStream) -> None:
        served.append(stream)
        await stream.recv()
        await stream.recv()
        await stream.send(ResponseHead(status=200))
        for _ in range(total // chunk):
            await stream.send(Data(b"z" * chunk))
        await stream.send(End())

    serve_with(b, flood)
    conn = await dial(a, b)
    stream = await conn.open_stream()
    await stream.send(RequestHead(id="1", path="/"))
    await stream.send(BodyEnd())
    # nobody reads: the sender must stall at about one window
    await eventually(lambda: bool(served) and served[0]._sent >= window)
    await asyncio.sleep(0.3)
    sender = served[0]
    assert sender._sent <= window + chunk + 64
    assert sender.unconsumed_sent <= window + chunk + 64
    assert len(stream._inbound) * chunk <= window + chunk
    received = 0
    async for frame in stream:
        if isinstance(frame, Data):
            received += len(frame.data)
    assert received == total


async def test_simultaneous_dials_collapse_to_one_connection(pair) -> None:
    a, b = pair
    ab, ba = await asyncio.gather(dial(a, b), dial(b, a))
    lower = min(a.identity.node_id, b.identity.node_id)
    await eventually(lambda: len(a.connections) == 1 and len(b.connections) == 1)
    kept_a, kept_b = a.connections[0], b.connections[0]
    # both sides keep the connection dialed by the lower node id
    assert kept_a.is_client == (a.identity.node_id == lower)
    assert kept_b.is_client == (b.identity.node_id == lower)
    assert ab is kept_a and ba is kept_b
    assert (await request(kept_a, "/x", b"q"))[-1] == End()


async def test_lower_ids_slow_dial_still_wins_a_simultaneous_dial() -> None:
    """The lower id's dial is slow to start (name lookup): the higher id's dial is through its
    handshake first. It must wait for the lower id's dial, not be accepted and replaced a
    moment after its ``connect`` returned it."""
    low, high = (
        TunnelEndpoint(ident, "127.0.0.1", 0, config=FAST)
        for ident in sorted((NodeIdentity.generate() for _ in range(2)), key=lambda i: i.node_id)
    )
    for endpoint in (low, high):
        serve_with(endpoint, echo_handler)
        await endpoint.start()
    resolve = low._resolve

    def handshaken_from_high() -> bool:
        return any(not c.is_client and c._handshake_done and c.control for c in low._all)

    async def slow_resolve(host: str, port: int) -> tuple[object, ...]:
        await eventually(handshaken_from_high)
        return await resolve(host, port)

    low._resolve = slow_resolve  # type: ignore[method-assign]
    try:
        to_high, to_low = await asyncio.gather(dial(low, high), dial(high, low))
        assert to_high.is_client and not to_low.is_client  # both hold the low id's dial
        assert not to_high.is_closed and not to_low.is_closed
        assert low.connections == [to_high] and high.connections == [to_low]
        assert (await request(to_low, "/x", b"q"))[-1] == End()
    finally:
        for endpoint in (low, high):
            await endpoint.close()


async def test_restarted_peer_gets_in_while_we_dial_its_dead_address() -> None:
    """We (the lower id) dial a peer's old address, dead since it restarted elsewhere. Its own
    dial to us must get in once ours gives up, and our ``connect`` returns that connection."""
    low_id, high_id = sorted((NodeIdentity.generate() for _ in range(2)), key=lambda i: i.node_id)
    low = TunnelEndpoint(low_id, "127.0.0.1", 0, config=replace(FAST, handshake_timeout=1.0))
    high = TunnelEndpoint(high_id, "127.0.0.1", 0, config=replace(FAST, handshake_timeout=30.0))
    for endpoint in (low, high):
        serve_with(endpoint, echo_handler)
        await endpoint.start()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as dead:  # never answers
            dead.bind(("127.0.0.1", 0))
            ours = asyncio.ensure_future(
                low.connect("127.0.0.1", dead.getsockname()[1], expected_node_id=high_id.node_id)
            )
            await eventually(lambda: bool(low._dials))
            theirs = await high.connect("127.0.0.1", low.port, expected_node_id=low_id.node_id)
            assert (await ours) is low.connection_for(high_id.node_id)
        assert not ours.result().is_client and not theirs.is_closed
        assert (await request(theirs, "/back", b"q"))[-1] == End()
    finally:
        for endpoint in (low, high):
            await endpoint.close()


async def test_endpoint_close_tells_the_peer(pair) -> None:
    a, b = pair
    conn = await dial(a, b)
    await eventually(lambda: b.connection_for(a.identity.node_id) is not None)
    server = b.connection_for(a.identity.node_id)
    assert server is not None
    await a.close()
    assert conn.is_closed
    await asyncio.wait_for(server.closed.wait(), 5)
    assert server.close_code == ErrorCode.SHUTDOWN


async def test_streams_are_rejected_without_a_handler(pair) -> None:
    a, b = pair

    async def on_connection(conn: PeerConnection) -> None:
        conn.mark_authenticated()  # but no on_stream

    b.on_connection = on_connection
    conn = await dial(a, b)
    with pytest.raises(StreamReset) as info:
        await request(conn, "/")
    assert info.value.code == ErrorCode.REJECTED


async def test_too_many_held_streams_are_rejected(pair) -> None:
    a, b = pair
    b.config = replace(FAST, max_held_streams=2)
    b.on_connection = None  # never authenticated
    conn = await dial(a, b)
    attempts = [asyncio.create_task(request(conn, f"/{i}")) for i in range(4)]
    await eventually(lambda: sum(t.done() for t in attempts) == 2)
    for task in attempts:
        if task.done():
            with pytest.raises(StreamReset):
                task.result()
        else:
            task.cancel()
    await asyncio.gather(*attempts, return_exceptions=True)


async def test_request_without_body_end_is_incomplete_for_the_handler(pair) -> None:
    a, b = pair
    seen: asyncio.Future = asyncio.get_running_loop().create_future()

    async def reader(stream: TunnelStream) -> None:
        try:
            async for _ in stream:
                pass
        except IncompleteResponse as exc:
            seen.set_result(exc)
            raise

    serve_with(b, reader)
    conn = await dial(a, b)
    stream = await conn.open_stream()
    await stream.send(RequestHead(id="1", path="/"))
    stream.finish()  # FIN without BodyEnd
    assert isinstance(await asyncio.wait_for(seen, 5), IncompleteResponse)


async def test_send_after_finish_and_after_loss(pair) -> None:
    a, b = pair
    conn = await dial(a, b)
    stream = await conn.open_stream()
    stream.finish()
    with pytest.raises(ClosedError):
        await stream.send(Data(b"x"))
    other = await conn.open_stream()
    conn.close(ErrorCode.SHUTDOWN, "test")
    with pytest.raises(ConnectionLost):
        await other.send(RequestHead(id="1", path="/"))
    with pytest.raises(ConnectionLost):
        await other.recv()


async def test_client_without_certificate_is_refused(pair) -> None:

    _, b = pair
    codes: list[int] = []

    class Recorder(QuicConnectionProtocol):
        def quic_event_received(self, event: QuicEvent) -> None:
            if isinstance(event, ConnectionTerminated):
                codes.append(event.error_code)

    config = QuicConfiguration(is_client=True, alpn_protocols=["mlx-mesh/1"])
    config.verify_mode = ssl.CERT_NONE
    async with connect("127.0.0.1", b.port, configuration=config, create_protocol=Recorder) as c:
        await asyncio.wait_for(c.wait_closed(), 5)
    assert codes == [ErrorCode.AUTH_FAILED]
    assert b.connections == []


async def test_wrong_alpn_never_connects(pair) -> None:

    _, b = pair
    config = QuicConfiguration(is_client=True, alpn_protocols=["h3"])
    config.verify_mode = ssl.CERT_NONE
    with pytest.raises(ConnectionError):
        async with connect("127.0.0.1", b.port, configuration=config):
            pass


async def test_broken_control_stream_closes_the_connection(pair) -> None:
    a, b = pair
    conn = await dial(a, b)
    await eventually(lambda: b.connection_for(a.identity.node_id) is not None)
    server = b.connection_for(a.identity.node_id)
    assert conn.control is not None and server is not None
    await conn.control.send(Data(b"not a control frame"))
    await asyncio.wait_for(server.closed.wait(), 5)
    assert server.close_code == ErrorCode.PROTOCOL
    await asyncio.wait_for(conn.closed.wait(), 5)


async def test_a_sender_that_ignores_the_window_is_cut_off(pair) -> None:
    a, b = pair

    async def rogue(stream: TunnelStream) -> None:
        await stream.recv()
        await stream.recv()
        stream._send_limit = 1 << 40  # pretend the reader granted unlimited credit
        await stream.send(ResponseHead(status=200))
        for _ in range(160):  # 2.5 MiB: beyond window + one maximal frame
            await stream.send(Data(b"r" * 16384))
        await asyncio.sleep(5)

    serve_with(b, rogue)
    conn = await dial(a, b)
    stream = await conn.open_stream()
    await stream.send(RequestHead(id="1", path="/"))
    await stream.send(BodyEnd())
    await eventually(lambda: stream.error is not None)
    with pytest.raises(ProtocolViolation, match="flow-control"):
        async for _ in stream:
            pass


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
async def test_ipv6_loopback() -> None:
    a = TunnelEndpoint(NodeIdentity.generate(), "::1", 0, config=FAST)
    b = TunnelEndpoint(NodeIdentity.generate(), "::1", 0, config=FAST)
    serve_with(b, echo_handler)
    await a.start()
    await b.start()
    try:
        conn = await a.connect("::1", b.port, expected_node_id=b.identity.node_id)
        assert (await request(conn, "/v6", b"six"))[1] == Data(b"SIX")
    finally:
        await a.close()
        await b.close()


async def test_concurrent_connects_share_one_dial(pair) -> None:
    a, b = pair
    conns = await asyncio.gather(*(dial(a, b) for _ in range(5)))
    assert all(c is conns[0] for c in conns)
    assert not conns[0].is_closed and len(a.connections) == 1
    await eventually(lambda: len(b.connections) == 1)
    assert not a._dials


def test_default_config_detects_a_dead_peer_in_under_5_seconds() -> None:
    config = TunnelConfig()
    # silence is checked every min(interval, timeout / 4) s after ping_timeout s of silence
    worst = config.ping_timeout + min(config.ping_interval, config.ping_timeout / 4)
    assert worst < 5.0
    assert config.ping_interval < config.ping_timeout  # a live idle peer is pinged in time


async def test_killed_peer_process_is_detected(pair) -> None:
    a, b = pair
    conn = await dial(a, b)
    assert b._server is not None
    b._server._transport.close()  # the peer's socket is gone: no CONNECTION_CLOSE ever comes
    await asyncio.wait_for(conn.closed.wait(), FAST.ping_timeout + 3)
    assert conn.close_code == ErrorCode.PING_TIMEOUT
    assert a.connections == []


async def test_restarted_peer_replaces_the_dead_connection_at_once() -> None:
    """The peer dies silently and comes back (same identity, new port) before the keep-alive
    noticed: its fresh dial must win even though the dead connection would win the tie."""
    idents = sorted((NodeIdentity.generate() for _ in range(2)), key=lambda i: i.node_id)
    slow_detect = replace(FAST, ping_timeout=30.0)  # only the staleness rule can help
    a = TunnelEndpoint(idents[0], "127.0.0.1", 0, config=slow_detect)  # the lower node id
    b1 = TunnelEndpoint(idents[1], "127.0.0.1", 0, config=slow_detect)
    b2 = TunnelEndpoint(idents[1], "127.0.0.1", 0, config=slow_detect)
    for endpoint in (a, b1, b2):
        serve_with(endpoint, echo_handler)
        await endpoint.start()
    try:
        old = await dial(a, b1)  # initiated by the lower id: it would win a plain tie-break
        assert b1._server is not None
        b1._server._transport.close()  # b1 dies without a word
        await eventually(lambda: old.silent_for > a.stale_after())
        fresh = await b2.connect("127.0.0.1", a.port, expected_node_id=a.identity.node_id)
        assert (await request(fresh, "/again", b"x"))[-1] == End()
        await eventually(lambda: old.is_closed)
        assert old.close_code == ErrorCode.SUPERSEDED
        assert a.connection_for(idents[1].node_id) is not old
    finally:
        for endpoint in (a, b1, b2):
            await endpoint.close()


# -- strangers get nothing: pre-authentication limits -----------------------------------------


def _stranger_config() -> QuicConfiguration:
    """A client with a valid self-signed Ed25519 certificate that never speaks our protocol."""
    identity = NodeIdentity.generate()
    config = QuicConfiguration(is_client=True, alpn_protocols=["mlx-mesh/1"])
    config.verify_mode = ssl.CERT_NONE
    config.certificate = identity.certificate
    config.private_key = identity.private_key
    return config


def _connect_stranger(port: int):
    return connect("127.0.0.1", port, configuration=_stranger_config(), create_protocol=_Silent)


class _Silent(QuicConnectionProtocol):
    """Completes TLS, then says nothing; records how the server closed it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.close_codes: list[int] = []

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ConnectionTerminated):
            self.close_codes.append(event.error_code)


async def test_a_stranger_that_never_opens_the_control_stream_is_closed_at_the_deadline(
    pair,
) -> None:
    _, b = pair
    b.config = replace(FAST, auth_deadline=0.5)
    async with _connect_stranger(b.port) as stranger:
        await asyncio.wait_for(stranger.wait_closed(), 5)
    assert stranger.close_codes == [ErrorCode.AUTH_FAILED]
    assert b.refusals["auth_deadline"] == 1


async def test_unauthenticated_connections_are_capped_per_address(pair) -> None:
    _, b = pair
    b.config = replace(FAST, max_preauth_per_address=2, auth_deadline=30.0)
    async with contextlib.AsyncExitStack() as stack:
        strangers = [await stack.enter_async_context(_connect_stranger(b.port)) for _ in range(3)]
        await eventually(lambda: any(s.close_codes for s in strangers))
        assert [s.close_codes for s in strangers] == [[], [], [ErrorCode.REJECTED]]
    assert b.refusals["preauth_per_address"] == 1


async def test_a_peer_that_sends_too_much_before_authenticating_is_closed(pair) -> None:
    a, b = pair
    b.config = replace(FAST, max_preauth_bytes=64 * 1024)
    b.on_connection = None  # never authenticated
    conn = await dial(a, b)
    stream = await conn.open_stream()
    await stream.send(RequestHead(id="big", path="/x", deadline=5.0))
    with contextlib.suppress(MeshError):
        for _ in range(8):
            await stream.send(Body(b"x" * 16 * 1024))
    await asyncio.wait_for(conn.closed.wait(), 5)
    assert conn.close_code == ErrorCode.AUTH_FAILED
    assert b.refusals["preauth_bytes"] == 1


# -- a copied home dir behind a hub ------------------------------------------------------------


async def test_a_copied_home_dir_behind_a_hub_is_refused_and_the_original_kept() -> None:
    hub = TunnelEndpoint(NodeIdentity.generate(), "127.0.0.1", 0, config=FAST)
    twin = NodeIdentity.generate()
    original = TunnelEndpoint(twin, "127.0.0.1", 0, config=FAST)
    copy = TunnelEndpoint(twin, "127.0.0.1", 0, config=FAST)  # the same key, another process
    for endpoint in (hub, original, copy):
        serve_with(endpoint, echo_handler)
        await endpoint.start()
    try:
        kept = await original.connect("127.0.0.1", hub.port, expected_node_id=hub.node_id)
        with pytest.raises(DuplicateNodeError, match="copied home dir"):
            await copy.connect("127.0.0.1", hub.port, expected_node_id=hub.node_id)
        assert hub.refusals["duplicate_node"] == 1
        assert (await request(kept, "/still", b"here"))[-1] == End()  # the original link lives
        assert hub.connection_for(twin.node_id) is not None and not kept.is_closed
    finally:
        for endpoint in (hub, original, copy):
            await endpoint.close()


async def test_a_peer_restarted_before_its_old_link_looks_stale_still_gets_in() -> None:
    """The probe tells it from a copy: its old connection no longer answers."""
    hub = TunnelEndpoint(NodeIdentity.generate(), "127.0.0.1", 0, config=FAST)
    me = NodeIdentity.generate()
    before = TunnelEndpoint(me, "127.0.0.1", 0, config=FAST)
    after = TunnelEndpoint(me, "127.0.0.1", 0, config=FAST)
    for endpoint in (hub, before, after):
        serve_with(endpoint, echo_handler)
        await endpoint.start()
    try:
        await before.connect("127.0.0.1", hub.port, expected_node_id=hub.node_id)
        await eventually(lambda: hub.connection_for(me.node_id) is not None)
        for conn in before.connections:  # dies without a word: its sockets just go
            conn._protocol._transport.close()
        fresh = await after.connect("127.0.0.1", hub.port, expected_node_id=hub.node_id)
        assert (await request(fresh, "/back", b"x"))[-1] == End()
        assert hub.refusals["duplicate_node"] == 0
    finally:
        for endpoint in (hub, before, after):
            await endpoint.close()
