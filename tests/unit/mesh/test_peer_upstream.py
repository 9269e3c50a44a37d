"""PeerUpstream (requesting side) against TunnelServer (serving side) over an in-memory stream
pair: the frame protocol, failure mapping before/after the commit point, and cancellation.
The same two classes run over real QUIC in test_mesh_e2e.py."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.events import (
    Done,
    Error,
    Meta,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)
from gateway.request import ChatRequest, Message
from gateway.testing import Raise, ScriptedUpstream, Sleep, Stall, text_script
from gateway.upstream import ModelInfo, StaticDirectory
from mesh.errors import ConnectError
from mesh.peer_upstream import PeerUpstream
from mesh.tunnel.stream import TunnelStream
from mesh.tunnel.testing import StreamPipe
from mesh.tunnel_server import TunnelServer

WINDOW = 1 << 16


class PipeConnection:
    """``open_stream`` hands the responder half to ``server.handle`` in a task."""

    def __init__(self, server: TunnelServer) -> None:
        self.server = server
        self.tasks: list[asyncio.Task] = []
        self.pipes: list[StreamPipe] = []

    async def open_stream(self) -> TunnelStream:
        pipe = StreamPipe(window=WINDOW, stream_id=0)
        self.pipes.append(pipe)
        self.tasks.append(asyncio.create_task(self.server.handle(pipe.responder, "peer")))
        return pipe.requester

    def lose(self) -> None:
        """The whole connection dies (a killed peer)."""
        for pipe in self.pipes:
            pipe.lose()

    async def join(self) -> None:
        await asyncio.wait_for(asyncio.gather(*self.tasks), 5)


def _setup(*steps, model="m", **server_kw):
    worker = ScriptedUpstream.of(*steps, name="local")
    local = StaticDirectory()
    local.add(ModelInfo(id=model), worker)
    server = TunnelServer(local, retry_backoff_s=0.01, **server_kw)
    connection = PipeConnection(server)

    async def connect():
        return connection

    return worker, server, connection, PeerUpstream(name="b" * 64, connect=connect, self_id="a")


def _request(model="m") -> ChatRequest:
    return ChatRequest(model=model, messages=[Message(role="user", content="hi")], temperature=0)


async def _collect(upstream: PeerUpstream, request: ChatRequest | None = None) -> list:
    return [event async for event in upstream.stream(request or _request())]


def _paced(script: list) -> list:
    """``script`` with a loop turn before each event, like an engine's decode steps: every
    event comes after the previous flush (in the pipe: the next loop iteration)."""
    return [step for event in script for step in (Sleep(0), event)]


async def test_events_cross_the_tunnel_unchanged():
    script = text_script("Hello mesh", chunk=2, reasoning="hmm")
    worker, server, connection, upstream = _setup(*_paced(script))
    events = await _collect(upstream)
    await connection.join()
    meta = [e for e in events if isinstance(e, Meta)]
    content = [e for e in events if not isinstance(e, Meta)]
    assert content == script  # paced tokens are never merged
    # The serving side's route headers arrive renamed so ours (x-route=peer) win.
    assert meta and meta[0].headers["x-peer-route"] == "local"
    assert "x-route" not in meta[0].headers
    assert worker.requests[0] == _request()
    assert server.served == 1 and server.active == 0


async def test_chat_logprobs_cross_the_tunnel_both_ways():
    """The request's logprobs knobs reach the serving node, and its token entries come back
    whole: back to back (merge-prone), each delta keeps its own tokens (issue #44)."""
    script = [
        TextDelta("He", logprobs=(TokenLogprob("He", -0.5, (TokenLogprob("He", -0.5),)),)),
        TextDelta("llo", logprobs=(TokenLogprob("l", -1.0), TokenLogprob("lo", -2.0))),
        TextDelta(" there", logprobs=(TokenLogprob(" there", -0.25),)),
        Usage(prompt_tokens=3, completion_tokens=4),
        Done(),
    ]
    worker, _, connection, upstream = _setup(*script)
    asked = _request().model_copy(update={"logprobs": True, "top_logprobs": 1})
    events = await _collect(upstream, asked)
    await connection.join()
    assert [e for e in events if not isinstance(e, Meta)] == script
    assert (worker.requests[0].logprobs, worker.requests[0].top_logprobs) == (True, 1)


async def test_back_to_back_deltas_merge_but_never_the_first_nor_across_other_events():
    """Text deltas that wait for the same flush become one; the first content event goes
    alone, a delta with a logprob or a reasoning delta is never merged, and other events keep
    their place."""
    script = [
        Usage(prompt_tokens=3, completion_tokens=0),  # an early prompt count: not content
        TextDelta("first"),
        TextDelta("a"),
        TextDelta("b"),
        TextDelta("c", logprob=-1.0),
        TextDelta("d"),
        ReasoningDelta("r"),  # counted as reasoning tokens: never merged
        ReasoningDelta("s"),
        TextDelta("e"),
        ToolCallDelta(index=0, id="call_0", name="f", arguments=""),
        TextDelta("g"),
        TextDelta("h"),
        Usage(prompt_tokens=3, completion_tokens=9),
        TextDelta("i"),
        Done("stop"),
    ]
    _, _, connection, upstream = _setup(*script)  # no loop turn between them: a free engine
    events = [e for e in await _collect(upstream) if not isinstance(e, Meta)]
    await connection.join()
    assert events == [
        Usage(prompt_tokens=3, completion_tokens=0),
        TextDelta("first"),
        TextDelta("ab"),
        TextDelta("c", logprob=-1.0),
        TextDelta("d"),
        ReasoningDelta("r"),
        ReasoningDelta("s"),
        TextDelta("e"),
        ToolCallDelta(index=0, id="call_0", name="f", arguments=""),
        TextDelta("gh"),
        Usage(prompt_tokens=3, completion_tokens=9),
        TextDelta("i"),
        Done("stop"),
    ]


async def test_merged_deltas_leave_at_the_flush_while_the_engine_is_still_busy():
    """A merge waits for the stream's next flush, not for the next event: an engine that
    stalls after a burst of tokens has the burst delivered."""
    burst = [TextDelta("first"), TextDelta("x"), TextDelta("y")]
    _, _, connection, upstream = _setup(*burst, Stall())
    events = upstream.stream(_request())
    seen = []
    async with asyncio.timeout(5):
        while len("".join(e.text for e in seen)) < len("firstxy"):
            event = await anext(events)
            if isinstance(event, TextDelta):
                seen.append(event)
    assert seen == [TextDelta("first"), TextDelta("xy")]
    await events.aclose()
    await connection.join()


async def test_model_not_served_there_is_retryable():
    _, _, connection, upstream = _setup(*text_script(), model="other")
    (event,) = await _collect(upstream)
    assert isinstance(event, Error) and event.retryable and event.kind == "unavailable"
    await connection.join()


async def test_overloaded_peer_is_retryable():
    worker, _, connection, upstream = _setup(*text_script(), max_concurrent=0)
    (event,) = await _collect(upstream)
    assert isinstance(event, Error) and event.retryable and event.kind == "overloaded"
    assert worker.calls == 0
    await connection.join()


async def test_connect_failure_is_retryable():
    async def connect():
        raise ConnectError("unreachable")

    upstream = PeerUpstream(name="b" * 64, connect=connect)
    (event,) = await _collect(upstream)
    assert isinstance(event, Error) and event.retryable and event.kind == "unavailable"


async def test_upstream_error_before_output_keeps_its_retryable_flag():
    _, _, connection, upstream = _setup(Raise(RuntimeError("worker died")))
    events = await _collect(upstream)
    assert isinstance(events[-1], Error) and events[-1].retryable
    await connection.join()


async def test_tunnel_lost_before_first_delta_is_retryable():
    _, _, connection, upstream = _setup(Stall())
    events = upstream.stream(_request())
    task = asyncio.create_task(anext(events))
    await asyncio.sleep(0.05)
    connection.lose()
    event = await asyncio.wait_for(task, 5)
    assert isinstance(event, Error) and event.retryable
    await events.aclose()
    await connection.join()


async def test_tunnel_lost_after_first_delta_is_final():
    _, _, connection, upstream = _setup(TextDelta("partial"), Stall())
    seen = []
    async for event in upstream.stream(_request()):
        seen.append(event)
        if isinstance(event, TextDelta):
            connection.lose()
    assert isinstance(seen[-1], Error)
    assert seen[-1].kind == "upstream" and not seen[-1].retryable
    await connection.join()


async def test_tunnel_lost_mid_answer_stays_retryable_for_a_client_that_waits_for_it_whole():
    """A non-stream client has seen nothing yet: the router may still try elsewhere. (The
    serving side holds a non-stream answer until it is whole, so nothing commits here.)"""
    worker, _, connection, upstream = _setup(TextDelta("partial"), Stall())
    events = upstream.stream(_request().model_copy(update={"stream": False}))
    pending = asyncio.ensure_future(_drain_events(events))
    await asyncio.wait_for(worker.started.wait(), 5)
    await asyncio.sleep(0.05)  # the worker has produced "partial" by now
    connection.lose()
    seen = await asyncio.wait_for(pending, 5)
    assert not any(isinstance(e, TextDelta) for e in seen)
    assert isinstance(seen[-1], Error)
    assert seen[-1].kind == "unavailable" and seen[-1].retryable
    await connection.join()


async def _drain_events(events) -> list:
    return [event async for event in events]


async def test_cancelling_the_consumer_cancels_the_peers_worker():
    worker, server, connection, upstream = _setup(TextDelta("one"), Stall())
    events = upstream.stream(_request())
    async for event in events:
        if isinstance(event, TextDelta):
            break
    await events.aclose()  # the client went away
    # The reset goes out before aclose returns (not when the garbage collector gets to it).
    (pipe,) = connection.pipes
    assert pipe.requester.done
    await connection.join()
    assert worker.cancelled == 1 and server.active == 0


async def test_usage_and_done_arrive_in_order():
    script = [TextDelta("x"), Usage(prompt_tokens=3, completion_tokens=1), Done("length")]
    _, _, connection, upstream = _setup(*script)
    events = [e for e in await _collect(upstream) if not isinstance(e, Meta)]
    assert events == script
    await connection.join()


@pytest.mark.parametrize("attempts", [2])
async def test_attempt_number_counts_calls_on_one_upstream(attempts):
    _, _, connection, upstream = _setup(*text_script())
    for _ in range(attempts):
        await _collect(upstream)
    assert upstream.calls == attempts
    await connection.join()


async def test_whole_answer_whose_end_frame_is_lost_still_counts():
    """Done arrived, then the connection died before End: the client has the whole answer."""
    import orjson

    from gateway.events import event_to_dict
    from mesh.tunnel.frames import BodyEnd, Data, ResponseHead

    class DiesBeforeEnd:
        async def handle(self, stream, peer_id: str = "") -> None:
            while not isinstance(await stream.recv(), BodyEnd):
                pass
            await stream.send(ResponseHead(status=200))
            for event in (TextDelta("all"), Done("stop")):
                await stream.send(Data(orjson.dumps(event_to_dict(event))))
            await asyncio.sleep(0.05)  # let the frames arrive, then die without End
            connection.lose()

    connection = PipeConnection(DiesBeforeEnd())  # type: ignore[arg-type]

    async def connect():
        return connection

    upstream = PeerUpstream(name="b" * 64, connect=connect)
    assert await _collect(upstream) == [TextDelta("all"), Done("stop")]
    await connection.join()


class _SlowToClose:
    """A local upstream whose close takes a few loop turns, like httpx closing a response."""

    name = "local"
    retryable = True
    start_hold = None

    def __init__(self) -> None:
        self.closing = asyncio.Event()
        self.closed = 0

    async def stream(self, request: ChatRequest):
        try:
            yield TextDelta("one")
            await asyncio.Event().wait()
        finally:
            self.closing.set()
            for _ in range(3):
                await asyncio.sleep(0)
            self.closed += 1


async def test_link_lost_while_cancelling_does_not_cut_the_upstreams_close_short():
    """The requester left (reset), then its connection died while the serving side was still
    closing its local upstream: the second cancellation must not interrupt that close (a worker
    connection left open generates to max_tokens)."""
    worker = _SlowToClose()
    local = StaticDirectory()
    local.add(ModelInfo(id="m"), worker)  # type: ignore[arg-type]
    connection = PipeConnection(TunnelServer(local, retry_backoff_s=0.01))

    async def connect():
        return connection

    upstream = PeerUpstream(name="b" * 64, connect=connect)
    events = upstream.stream(_request())
    async for event in events:
        if isinstance(event, TextDelta):
            break
    await events.aclose()  # the client went away: the stream is reset
    await worker.closing.wait()
    (handler,) = connection.tasks
    handler.cancel()  # the connection is lost meanwhile
    await asyncio.wait([handler])
    for _ in range(10):
        await asyncio.sleep(0)
    assert worker.closed == 1


@pytest.mark.parametrize(
    "event",
    [
        TextDelta("tok"),
        TextDelta("tok", logprob=-0.25),
        # Chat logprobs: the mean is set with the entries, so the short form never drops them.
        TextDelta("tok", logprobs=(TokenLogprob("tok", -0.25, (TokenLogprob("tok", -0.25),)),)),
        Usage(prompt_tokens=3, completion_tokens=2),
        Done("length"),
        Error(kind="upstream", message="m", code="x"),
        Meta({"x-route": "local"}),
    ],
)
def test_events_cross_the_tunnel_unchanged_and_none_defaults_stay_home(event) -> None:
    from mesh.peer_upstream import _decode_event
    from mesh.tunnel_server import _encode

    wire = _encode(event)
    assert _decode_event(wire) == event
    assert b"null" not in wire  # a None that is the default is not sent


_relayed_steps = st.lists(
    st.one_of(
        st.builds(TextDelta, st.text(max_size=3)),
        st.builds(TextDelta, st.text(max_size=3), st.floats(-5.0, 0.0)),  # with a logprob
        st.builds(ReasoningDelta, st.text(max_size=3)),
        st.builds(Usage, st.integers(0, 9), st.integers(0, 9)),
        st.just(Sleep(0)),  # a loop turn: the tokens before it have been flushed
    ),
    max_size=30,
)


def _canonical(events: list) -> list:
    """``events`` with neighbouring plain text deltas joined: what merging may change."""
    out: list = []
    for event in events:
        plain = type(event) is TextDelta and event.logprob is None
        if plain and out and type(out[-1]) is TextDelta and out[-1].logprob is None:
            out[-1] = TextDelta(out[-1].text + event.text)
        else:
            out.append(event)
    return out


@settings(max_examples=60, deadline=None)
@given(_relayed_steps)
def test_relayed_events_keep_their_order_text_and_first_delta_whatever_merges(steps) -> None:
    script = [*steps, Done("stop")]

    async def relay() -> list:
        _, _, connection, upstream = _setup(*script)
        events = [e for e in await _collect(upstream) if not isinstance(e, Meta)]
        await connection.join()
        return events

    got = asyncio.run(relay())
    sent = [step for step in script if not isinstance(step, Sleep)]
    assert _canonical(got) == _canonical(sent)
    content = [e for e in sent if not isinstance(e, Usage)]
    assert next(e for e in got if not isinstance(e, Usage)) == content[0]  # never merged
    assert len(got) <= len(sent)
