"""Responses WebSocket mode through the official SDK (``client.responses.connect()``) and a raw
client: turns back to back on one socket, continuation without resending history (also with
``store: false``), errors as messages, close codes, the API key and Origin on the upgrade."""

from __future__ import annotations

import asyncio

import openai
import orjson
import pytest
import websockets
from openresponses import check_event, validator

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.events import Error
from gateway.testing import RankedDirectory, ScriptedUpstream, ServerThread, Stall, text_script
from gateway.upstream import ModelInfo, Route, StaticDirectory

pytestmark = pytest.mark.e2e
KEY = "k" * 20


@pytest.fixture(scope="module")
def upstreams():
    return {
        "plain": ScriptedUpstream.of(*text_script("Paris is the capital.")),
        "stall": ScriptedUpstream.of(Stall()),
        # What the worker answers a prompt longer than the context (param: Chat's field).
        "overflow": ScriptedUpstream.of(
            Error(
                kind="invalid_request",
                message="prompt is too long: 9 tokens > 8 maximum",
                code="context_length_exceeded",
                details={"param": "messages"},
            )
        ),
    }


@pytest.fixture(scope="module")
def server(upstreams):
    directory = StaticDirectory()
    for name, upstream in upstreams.items():
        directory.add(ModelInfo(id=name), upstream)
    app = create_app(directory, GatewayConfig(api_key=KEY, retry_backoff_ms=1))
    with ServerThread(app) as srv:
        yield srv


def _ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/responses"


def _turn(connection) -> list:
    events = []
    for event in connection:
        events.append(event)
        if event.type in ("response.completed", "response.failed", "error"):
            return events
    raise AssertionError("the socket closed mid-turn")


def test_turns_on_one_socket_continue_without_resending(server, upstreams):
    plain = upstreams["plain"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with client.responses.connect() as connection:
        connection.response.create(model="plain", input="Capital of France?", store=False)
        first = _turn(connection)
        assert [e.sequence_number for e in first] == list(range(len(first)))
        assert first[0].type == "response.created" and first[-1].type == "response.completed"
        text = "".join(e.delta for e in first if e.type == "response.output_text.delta")
        assert text == "Paris is the capital."
        first_id = first[-1].response.id

        connection.response.create(
            model="plain", input="And Spain?", previous_response_id=first_id, store=False
        )
        second = _turn(connection)
        assert second[-1].type == "response.completed"
    roles = [m.role for m in plain.requests[-1].messages]
    assert roles == ["user", "assistant", "user"]  # the history came from the socket's memory
    assert plain.requests[-1].messages[1].content == "Paris is the capital."
    # store: false: nothing was kept beyond the socket
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first_id)


def test_a_warmup_generates_nothing_and_the_next_turn_chains_from_it(server, upstreams):
    """Codex opens a socket with ``generate: false`` (and sends ``stream: true`` every turn)."""
    plain = upstreams["plain"]

    async def run():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with websockets.connect(_ws_url(server), additional_headers=headers) as ws:
            calls = plain.calls
            warm = {"type": "response.create", "model": "plain", "input": "Capital of France?"}
            await ws.send(orjson.dumps({**warm, "generate": False, "store": False}).decode())
            events = [orjson.loads(await ws.recv()) for _ in range(3)]
            assert [e["type"] for e in events] == [
                "response.created",
                "response.in_progress",
                "response.completed",
            ]
            for event in events:
                check_event(event)
            assert events[-1]["response"]["output"] == [] and plain.calls == calls
            turn = {
                "type": "response.create",
                "model": "plain",
                "input": "Answer it.",
                "previous_response_id": events[-1]["response"]["id"],
                "stream": True,
                "store": False,
            }
            await ws.send(orjson.dumps(turn).decode())
            while (event := orjson.loads(await ws.recv()))["type"] != "response.completed":
                assert event["type"] != "error", event
        return [m.content for m in plain.requests[-1].messages]

    assert asyncio.run(run()) == ["Capital of France?", "Answer it."]


def test_errors_are_messages_and_the_socket_stays_usable(server):
    async def run():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with websockets.connect(_ws_url(server), additional_headers=headers) as ws:
            await ws.send("not json")
            error = orjson.loads(await ws.recv())
            assert error["type"] == "error" and error["status"] == 400
            ws_error = validator("/components/schemas/WebSocketErrorEvent")
            assert not list(ws_error.iter_errors(error)), error
            await ws.send(
                orjson.dumps({"type": "response.create", "model": "nobody", "input": "x"}).decode()
            )
            error = orjson.loads(await ws.recv())
            assert error["status"] == 404 and error["error"]["code"] == "model_not_found"
            body = {"type": "response.create", "model": "plain", "input": "x", "stream": False}
            await ws.send(orjson.dumps(body).decode())
            error = orjson.loads(await ws.recv())
            assert error["status"] == 400 and error["error"]["param"] == "stream"
            body = {
                "type": "response.create",
                "model": "plain",
                "input": "x",
                "previous_response_id": "resp_gone",
            }
            await ws.send(orjson.dumps(body).decode())
            error = orjson.loads(await ws.recv())
            assert not list(ws_error.iter_errors(error)), error
            assert error["status"] == 400  # the spec's WebSocket example (HTTP keeps its 404)
            assert error["error"] == {
                "type": "invalid_request_error",
                "code": "previous_response_not_found",
                "message": "Previous response with id 'resp_gone' not found.",
                "param": "previous_response_id",
            }
            await ws.send(
                orjson.dumps({"type": "response.create", "model": "plain", "input": "x"}).decode()
            )
            events = []
            while not events or events[-1]["type"] != "response.completed":
                events.append(orjson.loads(await ws.recv()))
            assert events[0]["type"] == "response.created"
            for event in events:  # the SSE stream's events, to the spec
                check_event(event)
            await ws.send(b"\x00binary")
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd.code == 1003

    asyncio.run(run())


def test_the_upgrade_needs_the_key_and_a_same_site_origin(server):
    async def run():
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(_ws_url(server)):
                pass
        assert refused.value.response.status_code == 401
        headers = {"Authorization": f"Bearer {KEY}", "Origin": "http://evil.example"}
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(_ws_url(server), additional_headers=headers):
                pass
        assert refused.value.response.status_code == 403

    asyncio.run(run())


def test_a_client_that_leaves_mid_turn_stops_the_generation(server, upstreams):
    stall = upstreams["stall"]

    async def run():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with websockets.connect(_ws_url(server), additional_headers=headers) as ws:
            await ws.send(
                orjson.dumps({"type": "response.create", "model": "stall", "input": "x"}).decode()
            )
            assert orjson.loads(await ws.recv())["type"] == "response.created"
        for _ in range(100):
            if stall.cancelled:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the stalled generation was not cancelled")

    asyncio.run(run())


def test_an_orphan_tool_output_is_refused_and_evicts_the_cached_response(server, upstreams):
    """A continuation whose tool output answers no call is a 400 naming the item; the failed
    continuation evicts the socket's cached response (``store: false``: it was the only copy),
    so continuing from it again is ``previous_response_not_found``."""
    plain = upstreams["plain"]

    async def run():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with websockets.connect(_ws_url(server), additional_headers=headers) as ws:
            turn = {"type": "response.create", "model": "plain", "input": "hi", "store": False}
            await ws.send(orjson.dumps(turn).decode())
            while (event := orjson.loads(await ws.recv()))["type"] != "response.completed":
                pass
            first_id = event["response"]["id"]
            calls = plain.calls
            orphan = {"type": "function_call_output", "call_id": "call_nobody", "output": "x"}
            follow = {**turn, "previous_response_id": first_id, "input": [orphan]}
            await ws.send(orjson.dumps(follow).decode())
            error = orjson.loads(await ws.recv())
            assert error["type"] == "error" and error["status"] == 400, error
            assert error["error"]["param"] == "input.0.call_id"
            assert plain.calls == calls
            again = {**turn, "previous_response_id": first_id, "input": "go on"}
            await ws.send(orjson.dumps(again).decode())
            error = orjson.loads(await ws.recv())
            assert error["type"] == "error", error
            assert error["error"]["code"] == "previous_response_not_found"

    asyncio.run(run())


def test_context_length_exceeded_names_the_responses_field(server):
    """The worker's overflow error names Chat's ``messages``; a Responses client is told
    ``input``, over HTTP (before and after the stream starts) and over the socket."""
    import httpx

    headers = {"Authorization": f"Bearer {KEY}"}
    url = server.url + "/v1/responses"
    body = {"model": "overflow", "input": "x"}
    refused = httpx.post(url, json=body, headers=headers)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert refused.json()["error"]["param"] == "input"
    streamed = httpx.post(url, json={**body, "stream": True}, headers=headers)
    errors = [
        orjson.loads(line[len("data: ") :])
        for line in streamed.text.splitlines()
        if line.startswith("data: {") and '"type":"error"' in line
    ]
    if streamed.status_code == 200:  # the error came as an event
        assert errors and errors[0]["error"]["param"] == "input"
    else:
        assert streamed.json()["error"]["param"] == "input"

    async def run():
        async with websockets.connect(_ws_url(server), additional_headers=headers) as ws:
            await ws.send(orjson.dumps({"type": "response.create", **body}).decode())
            while (event := orjson.loads(await ws.recv()))["type"] != "error":
                assert event["type"] != "response.completed"
            return event

    error = asyncio.run(run())
    assert error["error"]["param"] == "input", error


def test_a_turn_goes_where_the_mesh_ranks_it_and_a_warmup_is_not_ranked():
    """A turn on the socket takes the directory's cache-aware ranking (``aroutes``), as an HTTP
    request does; a warm-up runs nothing, so it is not ranked (nor noted as sent anywhere)."""
    a, b = (ScriptedUpstream.of(*text_script("Paris."), name=n) for n in ("a", "b"))
    directory = RankedDirectory()
    for upstream in (a, b):
        directory.add(ModelInfo(id="ranked"), upstream, kind="peer")
    directory.ranked["ranked"] = [Route(upstream=b, kind="peer", peer="b", reason="cache 8/9")]
    app = create_app(directory, GatewayConfig(api_key=KEY, retry_backoff_ms=1))

    async def run(url: str) -> None:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with websockets.connect(url, additional_headers=headers) as ws:
            ask = {"type": "response.create", "model": "ranked", "input": "Capital?"}
            await ws.send(orjson.dumps({**ask, "generate": False, "store": False}).decode())
            while (event := orjson.loads(await ws.recv()))["type"] != "response.completed":
                pass
            assert directory.asked == []
            await ws.send(orjson.dumps({**ask, "store": False}).decode())
            while (event := orjson.loads(await ws.recv()))["type"] != "response.completed":
                assert event["type"] != "error", event

    with ServerThread(app) as srv:
        asyncio.run(run(_ws_url(srv)))
    assert [r.model for r in directory.asked] == ["ranked"]
    assert (a.calls, b.calls) == (0, 1)
