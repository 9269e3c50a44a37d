"""Terminal guarantee: whatever the upstream does – finish, fail, raise, stall, end early – and
whenever the client leaves, every stream ends with its API's terminal or error event, and no
task is left running. Driven in-process through the whole ASGI app."""

from __future__ import annotations

import asyncio

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.events import Done, Error, Progress, ReasoningDelta, TextDelta, ToolCallDelta, Usage
from gateway.testing import Raise, ScriptedUpstream, Sleep, Stall, asgi_request
from gateway.upstream import ModelInfo, StaticDirectory

deltas = st.one_of(
    st.builds(TextDelta, st.text(max_size=5)),
    st.builds(ReasoningDelta, st.text(max_size=5)),
    st.builds(Progress, st.text(max_size=5)),
    st.builds(
        ToolCallDelta,
        index=st.integers(0, 1),
        id=st.just("c"),
        name=st.just("f"),
        arguments=st.text(max_size=4),
    ),
    st.just(Sleep(0.001)),
)
endings = st.sampled_from(["done", "length", "error", "retryable", "raise", "stall", "eof"])
ENDING_STEPS = {
    "done": [Usage(3, 2), Done("stop")],
    "length": [Done("length")],
    "error": [Error(kind="upstream", message="boom")],
    "retryable": [Error(kind="unavailable", message="busy", retryable=True)],
    "raise": [Raise(RuntimeError("kaput"))],
    "stall": [Stall()],
    "eof": [],
}
BODIES = {
    "/v1/chat/completions": {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
    },
    "/v1/responses": {"model": "m", "input": "x", "stream": True},
    "/v1/messages": {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
    },
}


def _frames(body: bytes) -> list[tuple[str | None, str]]:
    frames = []
    for block in body.decode().split("\n\n"):
        if not block or block.startswith(":"):
            continue
        event = None
        data = ""
        for line in block.split("\n"):
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        frames.append((event, data))
    return frames


def assert_terminated(path: str, status: int, body: bytes) -> None:
    if status != 200:
        payload = orjson.loads(body)
        assert "error" in payload
        return
    frames = _frames(body)
    assert frames, "a 200 stream must carry frames"
    if path == "/v1/chat/completions":
        assert frames[-1][1] == "[DONE]"
        assert sum(1 for _, d in frames if d == "[DONE]") == 1
    elif path == "/v1/responses":
        assert frames[-1][0] in ("response.completed", "response.incomplete", "response.failed")
        sequence = [orjson.loads(d)["sequence_number"] for _, d in frames]
        assert sequence == list(range(len(sequence)))
    else:
        assert frames[-1][0] in ("message_stop", "error")


async def _run_case(
    path: str, steps: list, disconnect_after: int | None, stream: bool = True
) -> None:
    upstream = ScriptedUpstream.of(*steps)
    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), upstream)
    config = GatewayConfig(header_wait_s=0.01, keepalive_s=0.005, retry_backoff_ms=1)
    app = create_app(directory, config)
    stalls = any(isinstance(s, Stall) for s in steps)
    result = await asgi_request(
        app,
        "POST",
        path,
        dict(BODIES[path], stream=stream),
        disconnect_after_chunks=disconnect_after,
        disconnect_after_s=0.05 if stalls else None,
    )
    client_left = (
        disconnect_after is not None and len(result.chunks) >= disconnect_after
    ) or stalls
    if not client_left and stream:
        assert_terminated(path, result.status, result.body)
    elif not client_left:  # a whole body: the answer, or an error in the API's shape
        payload = orjson.loads(result.body)
        assert bool(payload.get("error")) == (result.status != 200)
    await asyncio.sleep(0)
    assert upstream.active == 0
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert leftover == []


@settings(max_examples=40, deadline=None)
@given(
    path=st.sampled_from(list(BODIES)),
    body=st.lists(deltas, max_size=6),
    ending=endings,
    disconnect_after=st.one_of(st.none(), st.integers(1, 6)),
    stream=st.booleans(),
)
def test_every_stream_terminates_and_leaves_no_task(path, body, ending, disconnect_after, stream):
    asyncio.run(_run_case(path, [*body, *ENDING_STEPS[ending]], disconnect_after, stream))


def test_stalled_upstream_gets_keepalives_then_is_cancelled_on_disconnect():
    async def case() -> None:
        upstream = ScriptedUpstream.of(TextDelta("a"), Stall())
        directory = StaticDirectory()
        directory.add(ModelInfo(id="m"), upstream)
        app = create_app(directory, GatewayConfig(keepalive_s=0.01))
        # The client leaves once pings came (a chunk each after the three opening events),
        # not after a fixed time: a loaded machine may not have sent one within 0.1 s.
        result = await asgi_request(
            app,
            "POST",
            "/v1/messages",
            BODIES["/v1/messages"],
            disconnect_after_chunks=5,
            disconnect_after_s=30,
        )
        assert b"event: ping" in result.body
        assert upstream.cancelled == 1 and upstream.active == 0

    asyncio.run(case())


def test_chat_keepalive_is_a_comment_frame():
    async def case() -> None:
        upstream = ScriptedUpstream.of(TextDelta("a"), Sleep(0.06), Done())
        directory = StaticDirectory()
        directory.add(ModelInfo(id="m"), upstream)
        app = create_app(directory, GatewayConfig(keepalive_s=0.01))
        result = await asgi_request(
            app, "POST", "/v1/chat/completions", BODIES["/v1/chat/completions"]
        )
        assert b": keep-alive\n\n" in result.body
        assert result.body.endswith(b"data: [DONE]\n\n")
        assert result.headers["cache-control"] == "no-cache"
        assert result.headers["x-accel-buffering"] == "no"

    asyncio.run(case())


def test_non_streaming_request_cancels_upstream_on_disconnect():
    async def case() -> None:
        upstream = ScriptedUpstream.of(TextDelta("a"), Stall())
        directory = StaticDirectory()
        directory.add(ModelInfo(id="m"), upstream)
        app = create_app(directory, GatewayConfig())
        body = dict(BODIES["/v1/responses"], stream=False)
        result = await asgi_request(app, "POST", "/v1/responses", body, disconnect_after_s=0.05)
        assert result.status == 0  # nothing was sent: the client had gone
        assert upstream.cancelled == 1 and upstream.active == 0
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    asyncio.run(case())


def test_malformed_event_from_upstream_still_ends_with_an_error_frame():
    async def case() -> None:
        broken = ToolCallDelta(0, arguments=None)  # type: ignore[arg-type]
        upstream = ScriptedUpstream.of(
            TextDelta("a"), ToolCallDelta(0, id="c", name="f"), broken, Done()
        )
        directory = StaticDirectory()
        directory.add(ModelInfo(id="m"), upstream)
        app = create_app(directory, GatewayConfig())
        result = await asgi_request(
            app, "POST", "/v1/chat/completions", BODIES["/v1/chat/completions"]
        )
        frames = _frames(result.body)
        assert frames[-1][1] == "[DONE]"
        assert (
            orjson.loads(frames[-2][1])["error"]["message"] == "gateway encoder failed: TypeError"
        )

    asyncio.run(case())


def test_keepalives_flow_and_disconnect_cancels_over_real_http():
    import time

    import httpx

    from gateway.testing import ServerThread

    upstream = ScriptedUpstream.of(Stall())
    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), upstream)
    app = create_app(directory, GatewayConfig(keepalive_s=0.02, header_wait_s=0.05))
    with ServerThread(app) as server:
        seen = 0
        with httpx.stream(
            "POST", server.url + "/v1/chat/completions", json=BODIES["/v1/chat/completions"]
        ) as response:
            assert response.headers["x-route"] == "local"
            for line in response.iter_lines():
                seen += line == ": keep-alive"
                if seen == 3:
                    break
        deadline = time.monotonic() + 5
        while upstream.active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert upstream.cancelled == 1 and upstream.active == 0
