"""PeerUpstream: an :class:`~gateway.upstream.Upstream` that runs a request on a peer.

One tunnel stream per call::

    → RequestHead{path=/mesh/v1/chat, headers{x-mesh-hop, x-mesh-from}, deadline, attempt}
      Body(ChatRequest JSON) BodyEnd
    ← ResponseHead{status} Data(event JSON)* End

Failures are mapped so the gateway router can decide about retries (its commit point is the
first delta): anything before the first delta – connect/auth failure, ``REJECTED``, the tunnel
lost before the response, a 429/503 head – becomes a retryable ``Error``; after the first delta
it is ``Error(kind="upstream")``, never retried. Cancelling the consumer resets the stream with
``CANCELLED`` so the peer stops generating.

The directory makes a fresh ``PeerUpstream`` per routed request, so the number of calls on one
instance is the request's attempt number on that peer.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import orjson

from gateway.events import (
    RETRYABLE_KINDS,
    Done,
    Error,
    Event,
    EventDecodeError,
    Meta,
    event_from_dict,
    kind_for_status,
)
from gateway.request import ChatRequest
from gateway.router import CommitTracker
from gateway.upstream import Upstream
from mesh.errors import MeshError
from mesh.identity import short_id
from mesh.tunnel.frames import (
    Body,
    BodyEnd,
    Data,
    End,
    ErrorCode,
    RequestHead,
    ResponseHead,
    error_name,
)

log = logging.getLogger(__name__)

CHAT_PATH = "/mesh/v1/chat"
HOP_HEADER = "x-mesh-hop"
FROM_HEADER = "x-mesh-from"
DEFAULT_DEADLINE_S = 600.0
# The serving side's own route headers describe its local hop; keep them under other names so
# they do not overwrite ours (x-route=peer, x-peer=<node id>).
_REMOTE_RENAMES = {"x-route": "x-peer-route", "x-peer": "x-peer-upstream", "x-attempts": "x-peer-attempts"}  # fmt: skip


class StreamOpener(Protocol):
    async def open_stream(self): ...


@dataclass
class PeerUpstream(Upstream):
    """Runs requests on peer ``name`` (its node id) over the connection ``connect()`` returns.

    ``on_begin``/``on_end`` let the peer table count requests in flight there (routing load).
    """

    name: str
    connect: Callable[[], Awaitable[StreamOpener]]
    self_id: str = ""
    deadline_s: float = DEFAULT_DEADLINE_S
    on_begin: Callable[[str], None] | None = None
    on_end: Callable[[str], None] | None = None
    calls: int = field(default=0, init=False)

    async def stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        # One generator, not a wrapper around another: every token passes through each
        # generator layer, and a layer costs about a microsecond per token. Closed at a yield,
        # its finally resets the tunnel stream at once (not whenever the GC gets to it).
        attempt = self.calls
        self.calls += 1
        if self.on_begin is not None:
            self.on_begin(self.name)
        try:
            try:
                connection = await self.connect()
                stream = await connection.open_stream()
            except (MeshError, OSError, TimeoutError) as exc:
                yield _unavailable(f"cannot reach peer {short_id(self.name)}: {exc}")
                return
            reply = _Reply(self.name, CommitTracker(streaming=request.stream))
            try:
                early = await self._start(stream, request, attempt, reply)
                if early is not None:
                    yield early
                    return
                # A batch per wake-up: the peer's tokens come many to a datagram.
                while frames := await stream.recv_batch():
                    for frame in frames:
                        event = reply.on_frame(frame)
                        if event is not None:
                            yield event
                        if reply.complete:
                            return
                # recv_batch() returns [] only after End, which returned above.
                yield reply.commit.failure(_unavailable("peer stream ended without End"))
            except MeshError as exc:  # stream reset, connection lost, protocol violation
                log.info(
                    "peer %s stream failed (committed=%s): %s",
                    short_id(self.name),
                    reply.commit.committed,
                    exc,
                )
                yield reply.on_lost(exc)
            finally:
                if not reply.complete:
                    # Cancelled consumer or failure: tell the peer to stop generating.
                    stream.reset(ErrorCode.CANCELLED)
        finally:
            if self.on_end is not None:
                self.on_end(self.name)

    async def _start(self, stream, request: ChatRequest, attempt: int, reply: _Reply) -> Error | None:  # fmt: skip
        """Send the request and read the response head: None when events follow, else the
        error that ends the call."""
        head = RequestHead(
            id=secrets.token_hex(8),
            path=CHAT_PATH,
            headers={HOP_HEADER: "1", FROM_HEADER: self.self_id},
            deadline=self.deadline_s,
            attempt=attempt,
        )
        await stream.send(head)
        await stream.send(Body(request.model_dump_json().encode()))
        await stream.send(BodyEnd())
        first = await stream.recv()
        if isinstance(first, End):
            reply.complete = True
            return _error_for_end(first, self.name)
        if not isinstance(first, ResponseHead):
            return _unavailable(f"peer {short_id(self.name)} answered without a response head")
        if first.status != 200:
            reply.complete = await _drain(stream)
            return _error_for_status(first, self.name)
        return None


@dataclass
class _Reply:
    """The response side of one call: frames in, events out. ``complete``: End arrived."""

    peer: str
    commit: CommitTracker
    complete: bool = False
    terminal: Event | None = None  # Done/Error, held until End confirms the stream completed

    def on_frame(self, frame: object) -> Event | None:
        """The event to pass on for ``frame``, if any."""
        if type(frame) is End:
            self.complete = True
            if self.terminal is not None:
                return self.terminal
            return self.commit.failure(_error_for_end(frame, self.peer))
        if type(frame) is not Data or self.terminal is not None:
            return None
        event = _decode_event(frame.data)
        if isinstance(event, Meta):
            return Meta({_REMOTE_RENAMES.get(k, k): v for k, v in event.headers.items()})
        if isinstance(event, Done | Error):
            self.terminal = event
            return None
        self.commit.feed(event)
        return event

    def on_lost(self, exc: MeshError) -> Event:
        """The tunnel broke mid-answer: what the caller gets instead of the rest."""
        if self.terminal is not None:
            return self.terminal  # the answer was whole; only its closing frame got lost
        return self.commit.failure(_unavailable(f"tunnel to {short_id(self.peer)} lost: {exc}"))


def _unavailable(message: str) -> Error:
    return Error(kind="unavailable", message=message, retryable=True)


def _decode_event(data: bytes) -> Event:
    try:
        return event_from_dict(orjson.loads(data))
    except (orjson.JSONDecodeError, EventDecodeError) as exc:
        return Error(kind="upstream", message=f"peer sent a bad event: {exc}")


def _error_for_end(end: End, peer: str) -> Error:
    code = end.code
    text = f"peer {short_id(peer)}: {error_name(code)} {end.message}".strip()
    if code == ErrorCode.REJECTED:
        return Error(kind="unavailable", message=text, retryable=True)
    if code == ErrorCode.DEADLINE:
        return Error(kind="timeout", message=text)
    if code == ErrorCode.CANCELLED:
        return Error(kind="cancelled", message=text)
    return Error(kind="upstream", message=text, retryable=code == ErrorCode.NO_ERROR)


def _error_for_status(head: ResponseHead, peer: str) -> Error:
    message = head.headers.get("x-error", f"peer {short_id(peer)} answered {head.status}")
    kind = kind_for_status(head.status)
    return Error(kind=kind, message=message, retryable=kind in RETRYABLE_KINDS)


async def _drain(stream) -> bool:
    """Read to End after an error head; True if the exchange completed cleanly."""
    with contextlib.suppress(MeshError):
        async for frame in stream:
            if isinstance(frame, End):
                return True
    return False
