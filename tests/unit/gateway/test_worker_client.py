"""WorkerClient against a worker that goes silent or fails (an in-memory transport, no sockets):
its deadlines end the stream, and what fails before any output may go to another route."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import orjson

from gateway.deadlines import StreamDeadlines
from gateway.events import Done, Error, TextDelta
from gateway.request import ChatRequest, Message
from gateway.router import Router
from gateway.upstream import ModelInfo, StaticDirectory
from gateway.worker_client import WorkerClient

REQUEST = ChatRequest(model="m", messages=[Message(role="user", content="hi")], stream=True)


def _chunk(text: str) -> bytes:
    chunk = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _client(lines: list[bytes], deadlines: StreamDeadlines, *, then_stall: bool) -> WorkerClient:
    """A worker that sends ``lines`` and then either goes silent for good or says [DONE]."""

    async def body() -> AsyncIterator[bytes]:
        for line in lines:
            yield line
        if then_stall:
            await asyncio.Event().wait()  # a stopped process: the connection stays open
        yield b"data: [DONE]\n\n"

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    transport = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    return WorkerClient("http://worker", "m", client=transport, deadlines=deadlines)


async def _events(client: WorkerClient) -> list:
    return [event async for event in client.stream(REQUEST)]


async def test_a_worker_that_never_answers_ends_in_a_retryable_timeout() -> None:
    client = _client([], StreamDeadlines(first_token_s=0.2, idle_s=5.0), then_stall=True)
    started = time.monotonic()
    events = await _events(client)
    assert time.monotonic() - started < 2.0
    (error,) = events
    assert isinstance(error, Error) and error.kind == "timeout" and error.retryable
    assert "no first token within 0.2 s" in error.message


async def test_a_worker_silent_mid_answer_ends_in_a_timeout_that_is_not_retried() -> None:
    client = _client([_chunk("a")], StreamDeadlines(first_token_s=5.0, idle_s=0.2), then_stall=True)
    events = await _events(client)
    assert [type(e) for e in events] == [TextDelta, Error]
    assert events[-1].kind == "timeout" and not events[-1].retryable
    assert "nothing for 0.2 s mid-answer" in events[-1].message


async def test_lines_in_time_keep_a_stream_alive_past_the_first_token_deadline() -> None:
    """Each line moves the deadline on: four lines 0.1 s apart outlast a 0.25 s first-token
    deadline because the idle one (0.25 s) restarts with each."""

    async def slow() -> AsyncIterator[bytes]:
        for text in "abcd":
            await asyncio.sleep(0.1)
            yield _chunk(text)
        yield b"data: [DONE]\n\n"

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=slow())

    transport = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    deadlines = StreamDeadlines(first_token_s=0.25, idle_s=0.25)
    client = WorkerClient("http://worker", "m", client=transport, deadlines=deadlines)
    events = await _events(client)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "abcd"
    assert isinstance(events[-1], Done)


async def test_the_router_takes_a_first_token_timeout_to_the_next_route() -> None:
    """Nothing reached the client: the request goes on to another worker (Commit point)."""
    stuck = _client([], StreamDeadlines(first_token_s=0.1, idle_s=5.0), then_stall=True)
    stuck.name = "stuck"
    well = _client([_chunk("ok")], StreamDeadlines(), then_stall=False)
    well.name = "well"
    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), stuck)
    directory.add(ModelInfo(id="m"), well, kind="peer")
    router = Router(directory, retry_backoff_s=0.01)
    events = [e async for e in router.stream(REQUEST, router.resolve(REQUEST))]
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["ok"]
    assert isinstance(events[-1], Done)


async def test_a_worker_failing_a_job_before_any_output_is_unavailable_and_retryable() -> None:
    """Its engine failed or its split group broke: the worker's trouble, not the request's
    (one it refuses is a 4xx before the stream), so 503 with Retry-After or another route."""
    broke = {"error": {"message": "generation failed: the split group broke", "code": "internal"}}
    failing = _client(
        [b"data: " + orjson.dumps(broke) + b"\n\n"], StreamDeadlines(), then_stall=False
    )
    (error,) = await _events(failing)
    assert (error.kind, error.retryable, error.code) == ("unavailable", True, "internal")
    assert error.message == "generation failed: the split group broke"
    late = _client(
        [_chunk("a"), b"data: " + orjson.dumps(broke) + b"\n\n"],
        StreamDeadlines(),
        then_stall=False,
    )
    events = await _events(late)
    assert events[-1].kind == "upstream" and not events[-1].retryable  # after output: as it was
