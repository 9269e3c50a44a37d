"""One request's lifetime, shared by every API: parse → route → stream or collect → record.

Streaming: the HTTP response headers are held until the first upstream event or
``header_wait_s``, whichever comes first, so route ``Meta`` headers usually make it in and a
failure before any content still gets a proper HTTP status. An upstream with a
``start_hold`` (``model="mesh"``: ``x-moa-winner``) holds the start until that header
arrives, at most its ``wait_s``; every ``Meta``, even one after the start, ends up in
the request record. Then frames are written as events
arrive, with keep-alives while idle. A client disconnect cancels the upstream; the producer is
always closed before the response returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway import router, sse
from gateway.answer import Accumulator
from gateway.config import GatewayConfig
from gateway.events import (
    RETRYABLE_KINDS,
    ChoiceEvent,
    Done,
    Error,
    Event,
    Meta,
    Progress,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
)
from gateway.metrics import GatewayMetrics, RequestRecord
from gateway.refusals import RequestInvalid, ResponseStateError
from gateway.request import ChatRequest
from gateway.router import RouteError, Router
from gateway.stream import ProducerStream

log = logging.getLogger(__name__)

_DELTAS = (TextDelta, ReasoningDelta, ToolCallDelta)
# The router's facts about where a request went (gateway.router.route_headers).
_ROUTE_FACTS = ("x-route", "x-peer", "x-attempts", "x-retry-reasons", "x-mesh-route-reason", "x-mesh-hedge")  # fmt: skip


class Encoder(Protocol):
    acc: Accumulator  # the answer so far, folded in by ``encode``

    def start(self) -> bytes: ...
    def encode(self, event: Event) -> bytes: ...
    def keepalive(self) -> bytes: ...


class ExchangeState(Protocol):
    """The slice of the gateway's state a request's lifetime reads, and the counts it keeps."""

    config: GatewayConfig  # header_wait_s, keepalive_s
    router: Router
    metrics: GatewayMetrics
    in_flight: int
    waiting: int


# The state an API's hooks get: the gateway's, whose type the app names (an API's hooks may read
# more of it than the lifetime does, e.g. Responses its stored responses).
StateT = TypeVar("StateT", bound=ExchangeState)


@dataclass(frozen=True)
class ApiSpec(Generic[StateT]):
    """How one client API plugs into the shared request lifetime."""

    name: str
    parse: Callable[[dict[str, Any]], tuple[ChatRequest, Any]]
    make_encoder: Callable[[ChatRequest, Any], Encoder]
    make_body: Callable[[ChatRequest, Any, Accumulator], dict[str, Any]]
    error_body: Callable[[Error], dict[str, Any]]
    # The API renders MoA ``Progress`` notes (Responses: a reasoning summary). Then a note starts
    # the response: showing it while the models work is its whole point.
    shows_progress: bool = False
    # Parsing that needs the gateway's state (Responses: the stored ``previous_response_id``);
    # replaces ``parse`` when set. It may raise ``ResponseStateError`` (404, 503).
    parse_with_state: (
        Callable[[StateT, dict[str, Any]], Awaitable[tuple[ChatRequest, Any]]] | None
    ) = None
    # The request's events from the router (Chat: one call per choice when ``n > 1``); None
    # for the one routed call.
    open_stream: Callable[[Router, ChatRequest, Any, list], AsyncIterator[Event]] | None = None
    # Called with the final response object once there is one (Responses: store it).
    finish: Callable[[StateT, ChatRequest, Any, dict[str, Any]], None] | None = None
    # Takes a routed request over when it runs detached from its HTTP request (Responses'
    # ``background: true``): returns the response to send at once, or None for a normal one.
    detach: Callable[[StateT, ChatRequest, Any, list, RequestRecord], Response | None] | None = None


def json_response(
    payload: Any, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        orjson.dumps(payload), status_code=status, headers=headers, media_type="application/json"
    )


def error_response(
    spec_error_body: Callable[[Error], dict[str, Any]],
    error: Error,
    headers: dict[str, str] | None = None,
) -> Response:
    extra = dict(headers or {})
    if error.kind in RETRYABLE_KINDS:  # the client may come back soon: say when
        extra.setdefault("retry-after", "1")
    return json_response(spec_error_body(error), status=error.status, headers=extra)


class ApiEndpoint(Generic[StateT]):
    """The ASGI endpoint of one generating API (a plain ASGI app, not a request/response
    function, so Starlette adds no per-chunk ``send`` wrapper to the hot path)."""

    def __init__(self, spec: ApiSpec[StateT]) -> None:
        self.spec = spec

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await handle(Request(scope, receive), self.spec)
        await response(scope, receive, send)


async def handle(request: Request, spec: ApiSpec[StateT]) -> Response | EventResponse[StateT]:
    """The endpoint body for every generating API."""
    state: StateT = request.app.state.gateway
    raw: Any = None
    try:
        raw = orjson.loads(await request.body())
        if not isinstance(raw, dict):
            raise RequestInvalid("the request body must be a JSON object")
        if spec.parse_with_state is not None:
            chat_request, body = await spec.parse_with_state(state, raw)
        else:
            chat_request, body = spec.parse(raw)
    except (orjson.JSONDecodeError, RequestInvalid, ResponseStateError) as exc:
        if isinstance(exc, RequestInvalid):
            error = exc.to_error()
        elif isinstance(exc, ResponseStateError):
            error = exc.error
        else:
            error = Error(kind="invalid_request", message=f"malformed JSON: {exc}")
        # The log row keeps what the body said (metrics pool rejected models under one label).
        rejected = RequestRecord(api=spec.name, model="(unknown)", stream=False)
        if isinstance(raw, dict):
            model, stream = raw.get("model"), raw.get("stream")
            rejected.model = model[:200] if isinstance(model, str) and model else "(unknown)"
            rejected.stream = stream is True
        rejected.outcome, rejected.status = error.kind, error.status
        state.metrics.observe(rejected)
        return error_response(spec.error_body, error)
    if chat_request.session_key is None:
        chat_request.session_key = _session_header(request)
    record = RequestRecord(api=spec.name, model=chat_request.model, stream=chat_request.stream)
    try:
        routes = await state.router.aresolve(chat_request)
    except RouteError as exc:
        record.outcome, record.status = exc.error.kind, exc.error.status
        state.metrics.observe(record)
        return error_response(spec.error_body, exc.error)
    if spec.detach is not None:
        detached = spec.detach(state, chat_request, body, routes, record)
        if detached is not None:
            return detached
    return EventResponse(state, spec, chat_request, body, routes, record)


class EventResponse(Generic[StateT]):
    """A pure ASGI response that runs the upstream and writes its events in the API's format."""

    def __init__(
        self,
        state: StateT,
        spec: ApiSpec[StateT],
        request: ChatRequest,
        body: Any,
        routes: list,
        record: RequestRecord,
    ):
        self.state = state
        self.spec = spec
        self.request = request
        self.body = body
        self.routes = routes
        self.record = record
        self.acc = Accumulator()
        self.route_headers: dict[str, str] = dict(request.notes)
        self._sent_headers: dict[str, str] = {}  # the route facts the client has (headers, notes)
        self._t0 = time.perf_counter()
        self._waiting = False  # counted in state.waiting until the first content delta

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        if self.spec.open_stream is not None:
            events = self.spec.open_stream(state.router, self.request, self.body, self.routes)
        else:
            events = state.router.stream(self.request, self.routes)
        producer = ProducerStream(events)
        write = self._stream if self.request.stream else self._collect
        writer = asyncio.create_task(write(producer, send), name="gateway-writer")
        listener = asyncio.create_task(_wait_for_disconnect(receive), name="gateway-disconnect")
        state.in_flight += 1
        state.waiting += 1
        self._waiting = True
        state.metrics.in_flight.inc()
        try:
            await asyncio.wait([writer, listener], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (writer, listener):
                task.cancel()
            await asyncio.wait([writer, listener])
            await producer.aclose()
            state.in_flight -= 1
            self._stop_waiting()
            state.metrics.in_flight.dec()
            self._finish_record(writer)
        if not writer.cancelled() and (exc := writer.exception()) is not None:
            raise exc

    def _finish_record(self, writer: asyncio.Task) -> None:
        record = self.record
        record.duration_s = time.perf_counter() - self._t0
        record.route = self.route_headers
        record.route_reason = self.route_headers.get("x-mesh-route-reason")
        record.count_tokens(self.acc)
        if self.acc.error is not None:
            record.outcome = self.acc.error.kind
        elif self.acc.finish_reason is None:
            record.outcome = "cancelled"  # the client went away before the end
        self.state.metrics.observe(record)

    def _stop_waiting(self) -> None:
        if self._waiting:
            self._waiting = False
            self.state.waiting -= 1

    def _fold(self, event: Event, acc: Accumulator | None) -> None:
        """Note TTFT and route headers; fold content into ``acc`` unless an encoder already
        accumulates it (streaming: the encoder's accumulator becomes ``self.acc``)."""
        content = event.event if isinstance(event, ChoiceEvent) else event
        if self.record.ttft_s is None and isinstance(content, _DELTAS):
            self.record.ttft_s = time.perf_counter() - self._t0
            self._stop_waiting()
        if isinstance(event, Meta):
            self.route_headers.update(event.headers)
        if acc is not None:
            acc.add(event)

    async def _collect(self, producer: ProducerStream, send: Send) -> None:
        for event in await producer.collect():
            self._fold(event, self.acc)
        error = self.acc.error
        if error is not None:
            self.record.status = error.status
            response = error_response(self.spec.error_body, error, self.route_headers)
        else:
            body = self.spec.make_body(self.request, self.body, self.acc)
            self._finish(body)
            response = json_response(body, headers=self.route_headers)
        await response({"type": "http"}, _never_receive, send)

    def _finish(self, final: dict[str, Any] | None) -> None:
        if final is not None and self.spec.finish is not None:
            try:
                self.spec.finish(self.state, self.request, self.body, final)
            except Exception:  # storing is a service on top: never fail the answer for it
                log.exception("%s: could not finish the response", self.spec.name)

    async def _stream(self, producer: ProducerStream, send: Send) -> None:
        config = self.state.config
        loop = asyncio.get_running_loop()
        held = await self._hold_start(producer, loop.time() + config.header_wait_s)
        if held and isinstance(held[-1], Error):  # nothing sent yet: answer with a real status
            error = held[-1]
            self.acc.add(error)
            self.record.status = error.status
            response = error_response(self.spec.error_body, error, self.route_headers)
            await response({"type": "http"}, _never_receive, send)
            return
        if not any(k in self.route_headers for k in _ROUTE_FACTS):
            # a slow first event: only what is settled already
            self.route_headers = router.settled_headers(self.routes) | self.route_headers
        self._sent_headers = dict(self.route_headers)
        headers = [
            (k.encode(), v.encode()) for k, v in (sse.SSE_HEADERS | self.route_headers).items()
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        encoder = self.spec.make_encoder(self.request, self.body)
        self.acc = encoder.acc
        self.acc.add(Meta(dict(self.route_headers)))  # the facts known before the start
        chunk = encoder.start()
        frames, terminal = self._encode(encoder, held)
        chunk += frames
        if chunk:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        keepalive_s = config.keepalive_s
        while not terminal:
            event = await producer.next_or_idle(keepalive_s)
            if event is None:
                await send(
                    {"type": "http.response.body", "body": encoder.keepalive(), "more_body": True}
                )
                continue
            # Events already queued go out in the same write (whole frames only).
            frames, terminal = self._encode(encoder, [event, *producer.ready()], fold=True)
            if frames:
                await send({"type": "http.response.body", "body": frames, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _encode(
        self, encoder: Encoder, events: list[Event], fold: bool = False
    ) -> tuple[bytes, bool]:
        """Frames for ``events`` up to a terminal one, and whether it came. At the terminal
        event the response is finished (stored) before the client can see its end."""
        frames = b""
        for event in events:
            if fold:
                self._fold(event, None)
                if isinstance(event, Meta):
                    frames += self._late_route_note()
            frame, terminal = _encode_safely(encoder, event)
            frames += frame
            if terminal:
                self._finish(getattr(encoder, "final", None))  # only some encoders keep one
                return frames, True
        return frames, False

    def _late_route_note(self) -> bytes:
        """An SSE comment (every SDK skips it) with the route facts decided after the response
        started, e.g. the peer a retry went to; the request log has them too."""
        late = {
            k: v
            for k, v in self.route_headers.items()
            if k in _ROUTE_FACTS and self._sent_headers.get(k) != v
        }
        if not late:
            return b""
        self._sent_headers |= late
        return b": route " + " ".join(f"{k}={v}" for k, v in late.items()).encode() + b"\n\n"

    async def _hold_start(self, producer: ProducerStream, deadline: float) -> list[Event]:
        """The events read before the response starts (Metas folded into the headers).

        Normally that is the first event, or none by ``deadline``. An upstream that decides late
        (``model="mesh"``) has a ``start_hold``: then the start is held – content included –
        until its header arrives, bounded by its ``wait_s``. Facts that still
        come later reach the request record, just not the headers. A ``Progress`` note ends the
        wait only where the API shows it (then the decision headers are in the record only);
        elsewhere it is not content, and a failure soon after still gets a real status.
        """
        hold = self.routes[0].upstream.start_hold if self.routes else None
        awaited = hold.header if hold is not None else None
        loop = asyncio.get_running_loop()
        hold_until = max(deadline, loop.time() + (hold.wait_s if hold is not None else 0.0))
        held: list[Event] = []
        answering = False  # held anything but progress notes
        while True:
            pending = awaited is not None and awaited not in self.route_headers
            if answering and not pending:
                return held
            remaining = (hold_until if pending else deadline) - loop.time()
            if remaining <= 0:
                return held
            event = await producer.get(remaining)
            if event is None:
                return held
            self._fold(event, None)
            if isinstance(event, Meta):
                continue
            held.append(event)
            if isinstance(event, Progress) and self.spec.shows_progress:
                return held
            answering = answering or not isinstance(event, Progress)
            if isinstance(event, Done | Error):
                return held


# Headers agent harnesses send to keep a session on one worker (OpenCode: both), for requests
# whose body names no session (``prompt_cache_key``, ``user``, Anthropic ``metadata.user_id``).
_SESSION_HEADERS = ("x-session-affinity", "x-session-id")


def _session_header(request: Request) -> str | None:
    for name in _SESSION_HEADERS:
        value = request.headers.get(name, "").strip()
        if value:
            return value[:200]
    return None


def _encode_safely(encoder: Encoder, event: Event) -> tuple[bytes, bool]:
    """Frames for ``event`` and whether they end the stream. An encoder bug must not leave the
    client without a terminal event: it becomes an internal error frame instead."""
    try:
        return encoder.encode(event), isinstance(event, Done | Error)
    except Exception as exc:
        log.exception("encoder %s failed on %r", type(encoder).__name__, event)
        failure = Error(kind="internal", message=f"gateway encoder failed: {type(exc).__name__}")
        return encoder.encode(failure), True


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _never_receive() -> dict:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")
