"""The serving side of the tunnel: run a peer's request against this node's LOCAL routes only.

A request that arrived through the tunnel was already forwarded once (it carries the hop
marker), so it never goes to another peer: it runs on the local directory or is refused with
``End(REJECTED)`` (not processed, safe to retry elsewhere). Responses::

    ResponseHead{200} Data(event JSON)* End(NO_ERROR)     the events of the local router
    ResponseHead{4xx/429/503, x-error} End(REJECTED)      refused before any work
    End(REJECTED)                                         not ours to serve

If the requester resets the stream (it went away, or its client did) the local upstream is
cancelled at once, so the worker stops generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import ValidationError

from gateway.events import Error, Event, TextDelta, event_to_dict
from gateway.request import ChatRequest
from gateway.responses.state import LocalResponses
from gateway.router import CommitTracker, Router
from gateway.upstream import ModelDirectory
from mesh import response_relay
from mesh.delta_merge import DeltaMerge, mergeable
from mesh.errors import MeshError
from mesh.identity import short_id
from mesh.peer_upstream import CHAT_PATH
from mesh.tunnel.frames import Data, End, ErrorCode, RequestHead, ResponseHead

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20


@dataclass
class TunnelServer:
    """Answers request streams from authenticated peers with the local directory's routes."""

    local: ModelDirectory
    responses: LocalResponses | None = None  # this node's stored Responses, for peers to fetch
    # More paths (path → handler(stream, peer_id), called after the RequestHead): the split
    # rank orders, whose request body goes on for the stream's life.
    handlers: dict[str, Callable[[Any, str], Awaitable[None]]] = field(default_factory=dict)
    retry_backoff_s: float = 0.75
    max_concurrent: int = 64
    active: int = field(default=0, init=False)
    served: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._router = Router(self.local, retry_backoff_s=self.retry_backoff_s)

    async def handle(self, stream, peer_id: str = "") -> None:
        """Serve one request stream to its end. Never raises for peer misbehaviour."""
        try:
            await self._handle(stream, peer_id)
        except MeshError as exc:
            log.info("request stream from %s ended early: %s", short_id(peer_id), exc)
            stream.reset(ErrorCode.CANCELLED)

    async def _handle(self, stream, peer_id: str) -> None:
        head = await stream.recv()
        if not isinstance(head, RequestHead):
            stream.reset(ErrorCode.PROTOCOL)
            return
        handler = self.handlers.get(head.path)
        if handler is not None:  # a stream of its own kind: it reads its body itself
            await handler(stream, peer_id)
            return
        body = await stream.read_body(MAX_BODY_BYTES)
        if body is None:
            await _refuse(stream, 413, "request body too large")
            return
        if head.path == response_relay.RESPONSES_PATH and self.responses is not None:
            await response_relay.serve(stream, body, self.responses)
            return
        if head.path != CHAT_PATH:
            await _refuse(stream, 404, f"unknown path {head.path}")
            return
        try:
            request = ChatRequest.model_validate_json(body)
        except ValidationError as exc:
            await _refuse(stream, 400, f"bad request: {exc.error_count()} errors")
            return
        routes = self.local.routes(request.model, request.session_key)
        if not routes:
            await stream.send(
                End(code=ErrorCode.REJECTED, message=f"{request.model} not served here")
            )
            return
        if self.active >= self.max_concurrent:
            await _refuse(stream, 429, "too many forwarded requests")
            return
        self.active += 1
        try:
            await self._run(stream, request, routes, head.deadline)
        finally:
            self.active -= 1
            self.served += 1

    async def _run(self, stream, request: ChatRequest, routes, deadline: float | None) -> None:
        # Deferred: the head alone tells the requester nothing it acts on; it leaves with the
        # first token (or after flush_delay), one datagram instead of two.
        await stream.send(ResponseHead(status=200), defer=True)
        pump = asyncio.ensure_future(self._pump(stream, request, routes, deadline))
        watch = asyncio.ensure_future(stream.wait_broken())  # the requester reset or left
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not pump.done():
                log.info("requester reset the stream: cancelling the local upstream")
                pump.cancel()
            # Cancelled once, the pump closes its upstream (the worker's HTTP response). Wait
            # with asyncio.wait, which never cancels what it waits for: if this handler is
            # cancelled too (its connection lost meanwhile), a gather would cancel the pump a
            # second time and cut that close short, and the worker would run to max_tokens.
            await asyncio.wait([pump])
        if pump.cancelled():
            return  # the requester left: nobody to send End to
        pump.result()  # a send that failed because the requester stopped reading raises here
        # Deferred: on a busy connection End shares the next flush with the other streams'
        # tokens (a datagram and its ACK fewer per response); alone, it goes at once.
        await stream.send(End(), defer=True)

    async def _pump(self, stream, request: ChatRequest, routes, deadline: float | None) -> None:
        # aclosing: however the pump ends, the upstream is closed before it returns.
        async with contextlib.aclosing(self._router.stream(request, routes)) as events:
            commit = CommitTracker(streaming=True)
            merge = DeltaMerge()

            def send_merged() -> None:  # the stream's before_flush: what was gathered goes
                delta = merge.take()
                if delta is not None:
                    with contextlib.suppress(MeshError):  # the stream is gone, its reader too
                        stream.send_held(Data(_encode(delta)))

            try:
                async with asyncio.timeout(deadline):
                    async for event in events:
                        # The first content event (the client's TTFT) goes at once, with all
                        # before it; the others may wait a moment to share a datagram, and
                        # plain deltas waiting for the same flush become one (delta_merge.py).
                        # (Before the commit a delta commits: no merging there.)
                        if commit.committed and mergeable(event):
                            if not merge.pending:  # a new merge: credit for it, and a flush
                                await stream.wait_credit()
                                stream.before_flush(send_merged)
                            closed = merge.add(event)  # type: ignore[arg-type]
                            if closed is not None:
                                stream.send_held(Data(_encode(closed)))
                            continue
                        urgent = commit.feed(event)
                        send_merged()  # what was gathered goes before this event
                        await stream.send(Data(_encode(event)), defer=not urgent)
                    send_merged()
            except TimeoutError:
                send_merged()
                await stream.send(Data(_encode(Error(kind="timeout", message="deadline passed"))))


def _encode(event: Event) -> bytes:
    """The event's JSON for one Data frame, without the fields that are None by default (the
    reader's ``event_from_dict`` fills them in again): a token's ``"logprob":null`` alone was
    a third of its frame, and the tunnel's cost grows with the datagrams a stream fills."""
    if type(event) is TextDelta and event.logprob is None:  # most events: the short way
        return orjson.dumps({"t": "text", "text": event.text})
    out = event_to_dict(event)
    event_type: type = type(event)  # mypy takes the class of an unhashable dataclass for unhashable
    for name in _none_by_default(event_type):
        if out[name] is None:
            del out[name]
    return orjson.dumps(out)


@functools.cache
def _none_by_default(event_type: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(event_type) if f.default is None)


async def _refuse(stream, status: int, message: str) -> None:
    await stream.send(ResponseHead(status=status, headers={"x-error": message}))
    await stream.send(End(code=ErrorCode.REJECTED, message=message))
