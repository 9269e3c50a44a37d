"""Responses WebSocket mode: ``GET /v1/responses`` upgraded, ``response.create`` messages in,
the SSE stream's events out (one JSON text message per event).

Turns run one at a time per socket, in the order they were sent. The socket keeps its last
response in memory, so a turn that continues it by ``previous_response_id`` sends only its new
input and needs no store lookup – that works with ``store: false`` too, which is the mode's
point. An older id is looked up like over HTTP (the store, or its owner in the mesh). The API key
and the Host/Origin checks apply to the upgrade (gateway.middleware).

``generate: false`` warms up (Codex sends one as a socket opens): no model output, a completed
response with none, whose id the next turn chains from.

Errors that stop a turn before it starts (bad JSON, an unknown model, a missing previous
response, ``stream: false``, ``background: true``, ``stream_options``) are one ``error``
message with an HTTP-like ``status`` (the spec's WebSocketErrorEvent), and the socket stays
open. A binary frame closes it with 1003, an oversized one (uvicorn's ``ws_max_size``) with
1009. A socket that sends nothing for ``IDLE_S`` (15 minutes) is closed (1000); one that reaches
``MAX_AGE_S`` (60 minutes, the spec's limit) gets a ``websocket_connection_limit_reached`` error
and a close (1000) – at once when idle, after its turn when one is running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any, Protocol

import orjson
from starlette.types import Message
from starlette.websockets import WebSocket, WebSocketDisconnect

from gateway.config import GatewayConfig
from gateway.events import Done, Error, Meta, TextDelta
from gateway.metrics import GatewayMetrics, RequestRecord
from gateway.refusals import RequestInvalid, ResponseStateError
from gateway.request import ChatRequest
from gateway.responses import stored, wire
from gateway.responses.state import ResponseStates, stored_turn
from gateway.responses.store import StoredResponse
from gateway.router import RouteError, Router
from gateway.stream import ProducerStream

log = logging.getLogger(__name__)

IDLE_S = 15 * 60.0
MAX_AGE_S = 60 * 60.0
# Transport fields, and the one value each may have here: what the socket does anyway (Codex
# sends ``stream: true``); ``stream_options`` means nothing on a socket (null at most).
_TRANSPORT_FIELDS: dict[str, bool | None] = {
    "stream": True,
    "background": False,
    "stream_options": None,
}


def error_message(error: Error) -> dict[str, Any]:
    """The spec's WebSocketErrorEvent: an HTTP-like status and the OpenAI error object.

    ``previous_response_not_found`` is a 400 ``invalid_request_error`` here, as in the spec's
    and OpenAI's WebSocket examples (over HTTP it stays the spec's ``not_found`` 404)."""
    if error.code == "previous_response_not_found":
        error = dataclasses.replace(error, kind="invalid_request")
    return {"type": "error", "status": error.status, **wire.error_body(error)}


class SocketState(Protocol):
    """The slice of the gateway's state WebSocket mode reads (where turns run and are stored,
    the in-flight limit) and counts in: its turns are counted as the HTTP requests are."""

    config: GatewayConfig  # max_in_flight
    router: Router
    metrics: GatewayMetrics
    responses: ResponseStates
    in_flight: int
    in_flight_guarded: int


class _Socket:
    """One WebSocket connection's state: its last response, kept for a cheap continuation."""

    def __init__(self, websocket: WebSocket) -> None:
        self.ws = websocket
        self.state: SocketState = websocket.app.state.gateway
        self.opened = time.monotonic()
        self.last: StoredResponse | None = None
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.current: asyncio.Task[None] | None = None  # the turn running
        self.continues = False  # the turn running continues ``last`` (from memory)

    async def send(self, payload: dict[str, Any]) -> None:
        await self.ws.send_text(orjson.dumps(payload).decode())

    async def read(self) -> None:
        """Every message into the inbox (a turn in progress must see a disconnect at once)."""
        try:
            while True:
                message = await self.ws.receive()
                self.inbox.put_nowait(message)
                if message["type"] == "websocket.disconnect":
                    return
        finally:
            if self.current is not None:  # the client went away: stop its generation
                self.current.cancel()

    async def serve(self) -> None:
        while True:
            if self._age_limit_reached():
                await self._close_at_age_limit()
                return
            age = time.monotonic() - self.opened
            wait_s = min(IDLE_S, MAX_AGE_S - age)
            try:
                message = await asyncio.wait_for(self.inbox.get(), wait_s)
            except TimeoutError:
                if self._age_limit_reached():
                    continue  # the limit, not idleness: say so before closing
                await self.ws.close(code=1000, reason="idle")
                return
            if message["type"] == "websocket.disconnect":
                return
            if message.get("bytes") is not None:
                await self.ws.close(code=1003, reason="text frames only")
                return
            if self._age_limit_reached():
                await self._close_at_age_limit()
                return
            self.current = asyncio.create_task(self.turn(message.get("text") or ""))
            await asyncio.wait([self.current])  # cancelled by ``read`` if the client leaves
            if self.current.cancelled():
                return
            if (exc := self.current.exception()) is not None:  # a bug: say so, keep serving
                log.error("responses websocket turn failed", exc_info=exc)
                failure = Error(kind="internal", message=f"internal error ({type(exc).__name__})")
                await self.send(error_message(failure))
            self.current = None

    def _age_limit_reached(self) -> bool:
        return time.monotonic() - self.opened >= MAX_AGE_S

    async def _close_at_age_limit(self) -> None:
        """The spec's 60-minute connection limit: an error message, then a clean close. A turn
        running at the limit finishes first (its stream ends with its terminal event)."""
        limit = Error(
            kind="invalid_request",
            message=f"this connection is older than {MAX_AGE_S / 60:.0f} minutes: open a new one",
            code="websocket_connection_limit_reached",
        )
        await self.send(error_message(limit))
        await self.ws.close(code=1000, reason="connection limit reached")

    async def turn(self, text: str) -> None:
        self.continues = False
        try:
            request, body, generate = await self._parse(text)
            # Ranked by cached prefix only for a turn that runs: a warm-up (generate: false)
            # sends nothing, and ranking would note its prompt as sent to the first node.
            router = self.state.router
            routes = await router.aresolve(request) if generate else router.resolve(request)
        except RequestInvalid as exc:
            await self._refuse(exc.to_error())
            return
        except (ResponseStateError, RouteError) as exc:
            await self._refuse(exc.error)
            return
        if not generate:
            await self._warm(request, body)
            return
        state = self.state
        if state.in_flight_guarded >= state.config.max_in_flight:
            limit = state.config.max_in_flight
            busy = Error(kind="overloaded", message=f"too many requests in flight (limit {limit})")
            await self._refuse(busy)
            return
        state.in_flight_guarded += 1
        try:
            await self._run(request, body, routes)
        finally:
            state.in_flight_guarded -= 1

    async def _refuse(self, error: Error) -> None:
        """A turn that fails before it starts. A failed continuation of the cached response
        evicts it (the spec): continuing from it again needs the store, or fails with
        ``previous_response_not_found`` when it was ``store: false``."""
        if self.continues:
            self.last = None
        await self.send(error_message(error))

    async def _parse(self, text: str) -> tuple[ChatRequest, wire.ResponsesBody, bool]:
        """The turn's request and body, and whether to generate (``generate: false`` only
        warms up: see :meth:`_warm`)."""
        try:
            raw = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise RequestInvalid(f"malformed JSON: {exc}") from exc
        if not isinstance(raw, dict) or raw.get("type") != "response.create":
            raise RequestInvalid("type: every message must be a response.create", "type")
        last = self.last
        self.continues = last is not None and raw.get("previous_response_id") == last.id
        for name, allowed in _TRANSPORT_FIELDS.items():
            if name in raw and raw[name] is not allowed:
                raise RequestInvalid(f"{name}: not used in WebSocket mode (always streamed)", name)
        generate = raw.get("generate", True)
        if not isinstance(generate, bool):
            raise RequestInvalid("generate: must be a boolean", "generate")
        raw = {k: v for k, v in raw.items() if k not in ("type", "generate")} | {"stream": True}
        if last is not None and self.continues:
            return (*stored.parse_with_prior(self.state, raw, last.context), generate)
        return (*await stored.parse(self.state, raw), generate)

    async def _warm(self, request: ChatRequest, body: wire.ResponsesBody) -> None:
        """``generate: false``: no model output, a completed response with none, whose state
        (the context so far) the socket keeps, so the next turn can chain from its id."""
        encoder = wire.ResponsesStreamEncoder(request, body, body._response_id)
        for payload in [*encoder.start_events(), *encoder.events(Done())]:
            await self.send(payload)
        if encoder.final is not None:
            self._keep(request, body, encoder.final)

    def _keep(self, request: ChatRequest, body: wire.ResponsesBody, final: dict) -> None:
        """The finished response: stored (unless ``store: false``) and kept on the socket."""
        stored.finish(self.state, request, body, final)
        self.last = stored_turn(body, final)

    async def _run(self, request: ChatRequest, body: wire.ResponsesBody, routes) -> None:
        state = self.state
        record = RequestRecord(api="responses.ws", model=request.model, stream=True)
        encoder = wire.ResponsesStreamEncoder(request, body, body._response_id)
        producer = ProducerStream(state.router.stream(request, routes))
        t0 = time.perf_counter()
        state.in_flight += 1
        try:
            for payload in encoder.start_events():
                await self.send(payload)
            while True:
                event = await producer.get()
                if isinstance(event, Meta):
                    record.route.update(event.headers)
                    encoder.acc.add(event)  # the x-moa-* facts reach the response's metadata
                    continue
                if record.ttft_s is None and isinstance(event, TextDelta):
                    record.ttft_s = time.perf_counter() - t0
                for payload in encoder.events(event):
                    await self.send(payload)
                if isinstance(event, Done | Error):
                    break
        finally:
            await producer.aclose()
            state.in_flight -= 1
            self._finish(request, body, encoder, record, time.perf_counter() - t0)

    def _finish(self, request, body, encoder, record: RequestRecord, duration_s: float) -> None:
        if encoder.final is not None:
            self._keep(request, body, encoder.final)
        acc = encoder.acc
        record.duration_s = duration_s
        record.count_tokens(acc)
        record.outcome = (
            acc.error.kind if acc.error else ("ok" if acc.finish_reason else "cancelled")
        )
        self.state.metrics.observe(record)


async def endpoint(websocket: WebSocket) -> None:
    await websocket.accept()
    socket = _Socket(websocket)
    reader = asyncio.create_task(socket.read(), name="responses-ws-reader")
    try:
        with contextlib.suppress(WebSocketDisconnect):
            await socket.serve()
    finally:
        reader.cancel()
        await asyncio.wait([reader])
