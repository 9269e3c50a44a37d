"""One QUIC connection to one peer: the aioquic event adapter behind ``PeerConnection``.

See ``mesh/tunnel/__init__.py`` for the API as a whole. This module turns aioquic events into tunnel
behaviour: certificate pinning and duplicate-node detection at handshake, the control stream,
holding peer streams until the connection is authenticated, keep-alive pings with a timeout,
resets surfaced to readers, and ``ConnectionLost`` for every stream when the connection dies.

A connection talks to whoever keeps the table of connections (the endpoint) only through the
small :class:`ConnectionRegistry` protocol; the tie-break rules themselves are pure
(``registry.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from aioquic.quic import events
from aioquic.quic.connection import QuicConnection
from cryptography import x509

from mesh.errors import (
    AuthFailed,
    ClosedError,
    ConnectError,
    ConnectionLost,
    DuplicateNodeError,
    MeshError,
    StreamLost,
    Superseded,
)
from mesh.identity import short_id
from mesh.tunnel.config import TunnelConfig
from mesh.tunnel.frames import ErrorCode, StreamRole, Window, encode, error_name
from mesh.tunnel.pins import Pin, peer_certificate, verify_peer
from mesh.tunnel.stream import TunnelStream

log = logging.getLogger(__name__)
# Past the silence deadline by this much when the ping loop wakes for it (timer granularity).
_WAKE_SLACK_S = 0.01

StreamHandler = Callable[[TunnelStream], Awaitable[None]]
CONTROL_STREAM_ID = 0  # the client's first bidirectional stream


class ConnectionRegistry(Protocol):
    """What a connection needs from the table of connections it belongs to (the endpoint)."""

    @property
    def node_id(self) -> str: ...  # ours

    @property
    def config(self) -> TunnelConfig: ...

    def hold_for(self, incoming: PeerConnection) -> asyncio.Future[Any] | None:
        """What ``incoming`` must wait for before it may register (our own dial to the same
        peer, or a liveness probe of the connection it would replace), if anything."""

    def register(self, conn: PeerConnection) -> ErrorCode | None:
        """Make ``conn`` THE connection to its peer; else the code to close it with
        (SUPERSEDED: the other connection wins the tie; DUPLICATE_NODE: a copied home dir)."""

    def announce(self, conn: PeerConnection) -> None:
        """``conn`` is ready: hand it to the application."""

    def unregister(self, conn: PeerConnection) -> None:
        """``conn`` died: it is no longer the connection to its peer."""

    def forget(self, conn: PeerConnection) -> None:
        """aioquic finished closing ``conn``: drop the last reference."""

    def report_duplicate(self, exc: DuplicateNodeError) -> None:
        """The peer has our own node id (a copied home dir)."""

    def admit_unauthenticated(self, conn: PeerConnection) -> bool:
        """Whether one more not-yet-authenticated connection from its address may wait."""

    def count_refusal(self, reason: str) -> None:
        """A stranger was turned away (for metrics)."""


class QuicLink(Protocol):
    """The aioquic side of one connection (``protocol.TunnelProtocol``)."""

    _quic: QuicConnection
    last_heard: float  # loop time of the last datagram from the peer

    def transmit(self) -> None: ...

    def transmit_soon(self, nbytes: int, *, defer: bool) -> None: ...

    def _transmit_soon(self) -> None: ...

    def terminated(self) -> None: ...


class ConnectionState(enum.Enum):
    HANDSHAKE = "handshake"  # TLS and pins, then the control stream
    HELD = "held"  # waiting for our own dial to the same peer to end (its tie rule)
    READY = "ready"  # THE connection to the peer; its streams wait for authentication
    AUTHENTICATED = "authenticated"  # the membership handshake passed: peer streams are served
    CLOSED = "closed"


_CLOSE_ERRORS: dict[int, type[ConnectError]] = {
    ErrorCode.AUTH_FAILED: AuthFailed,
    ErrorCode.DUPLICATE_NODE: DuplicateNodeError,
    ErrorCode.SUPERSEDED: Superseded,
}


class PeerConnection:
    """A live, pinned QUIC connection to one peer, usable in both directions.

    Attributes: ``peer_node_id``, ``peer_public_key`` (raw Ed25519), ``peer_cert_fingerprint``,
    ``peer_address``, ``is_client`` (we dialed), ``rtt`` (seconds, from pings; None until the
    first), ``authenticated`` (event), ``closed`` (event), ``close_code``/``close_reason``,
    ``control`` (the control stream), ``on_stream`` (handler for peer-opened streams)."""

    def __init__(
        self,
        registry: ConnectionRegistry,
        protocol: QuicLink,
        is_client: bool,
        pin: Pin | None,
    ) -> None:
        self.is_client = is_client
        self.peer_node_id: str | None = None
        self.peer_public_key: bytes | None = None
        self.peer_cert_fingerprint: str | None = None
        self.peer_certificate: x509.Certificate | None = None
        self.rtt: float | None = None
        self.on_stream: StreamHandler | None = None
        self.authenticated = asyncio.Event()
        self.closed = asyncio.Event()
        self.close_code: int | None = None
        self.close_reason = ""
        self.control: TunnelStream | None = None
        self.state = ConnectionState.HANDSHAKE
        self._registry = registry
        self._config: TunnelConfig = registry.config
        self._protocol = protocol
        self._quic: QuicConnection = protocol._quic
        self._pin = pin
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[None] = self._loop.create_future()
        self._ready.add_done_callback(_retrieve)  # failures are raised to connect(), if any
        self._handshake_done = False
        self._streams: dict[int, TunnelStream] = {}
        self._deferred: dict[int, _Held] = {}  # stream id → writes waiting for the flush
        self._flush_hooks: dict[int, Callable[[], None]] = {}  # stream id → its before_flush
        self._held: list[TunnelStream] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._next_stream_id = 0 if is_client else 1
        self._highest_peer_stream = -1
        self._pings: dict[int, asyncio.Future[None]] = {}
        self._ping_ids = itertools.count(1)
        self._keepalive: asyncio.Task[None] | None = None
        self._lost: ConnectionLost | None = None
        self._preauth_bytes = 0  # request-stream bytes received before authentication
        # The deadline runs from the first packet, not from the control stream: a stranger that
        # completes TLS and then never speaks must not hold the connection (and its memory).
        self._auth_timer: asyncio.TimerHandle | None = self._loop.call_later(
            self._config.auth_deadline, self._auth_expired
        )

    # ---- public API ----

    @property
    def peer_address(self) -> tuple[str, int] | None:
        addr = self._quic.get_peer_address()
        return (addr[0], addr[1]) if addr else None

    @property
    def peer_host(self) -> str | None:
        """The peer's IP as a TCP side channel dials it (peer copy, the split ring bridge):
        an IPv4-mapped IPv6 address of a dual-stack socket as plain IPv4."""
        address = self.peer_address
        return address[0].removeprefix("::ffff:") if address is not None else None

    @property
    def is_closed(self) -> bool:
        return self._lost is not None

    @property
    def handshake_done(self) -> bool:
        """TLS finished and the peer's certificate passed the pins."""
        return self._handshake_done

    @property
    def is_ready(self) -> bool:
        """Established: handshake done, pins checked, registered as THE connection to the peer."""
        return (
            self._ready.done() and not self._ready.cancelled() and self._ready.exception() is None
        )

    @property
    def silent_for(self) -> float:
        """Seconds since the last datagram from the peer."""
        return self._loop.time() - self._protocol.last_heard

    @property
    def active_streams(self) -> int:
        """Request streams not yet done in both directions (the control stream not counted)."""
        return sum(1 for s in self._streams.values() if s is not self.control)

    def mark_authenticated(self) -> None:
        """Allow peer-opened streams to be served (held ones are dispatched now)."""
        if self.authenticated.is_set():
            return
        if self._lost is None:
            self._set_state(ConnectionState.AUTHENTICATED)
        self._cancel_auth_timer()
        self.authenticated.set()
        held, self._held = self._held, []
        for stream in held:
            if not stream.done:
                self._serve(stream)

    async def open_stream(self) -> TunnelStream:
        """A new request stream (we send RequestHead...; the peer answers)."""
        if self._lost is not None:
            raise self._lost
        if not self._ready.done() or self._ready.exception() is not None:
            raise ClosedError("connection is not established")
        stream_id = self._next_stream_id
        self._next_stream_id += 4
        stream = TunnelStream(self, stream_id, StreamRole.RESPONSE, self._config.stream_window)
        self._streams[stream_id] = stream
        return stream

    def close(self, code: int = ErrorCode.NO_ERROR, reason: str = "") -> None:
        """Close the connection with an application ``code`` (an ErrorCode); idempotent.
        Every open stream gets ``ConnectionLost``."""
        if self._lost is not None:
            return
        self._quic.close(error_code=int(code), reason_phrase=reason)
        self._protocol.transmit()
        self._mark_lost(ConnectionLost(f"closed locally: {error_name(code)} {reason}", int(code)))

    async def wait_closed(self) -> None:
        await self.closed.wait()

    async def wait_ready(self) -> None:
        """Handshake done, pins checked, control stream up. Raises the ConnectError subtype."""
        await asyncio.shield(self._ready)

    def probe_alive(self, within_s: float) -> asyncio.Future[bool]:
        """Ping now; True once anything is heard from the peer after this call, False when
        ``within_s`` passes first (or the connection dies)."""
        task = self._loop.create_task(self._probe(within_s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _probe(self, within_s: float) -> bool:
        start = self._loop.time()
        self._quic.send_ping(next(self._ping_ids))  # its ack (or anything else) proves life
        self._protocol.transmit()
        while self._lost is None and self._loop.time() - start < within_s:
            if self._protocol.last_heard > start:
                return True
            await asyncio.sleep(0.01)
        return False

    def _auth_expired(self) -> None:
        self._auth_timer = None
        if self.authenticated.is_set() or self._lost is not None:
            return
        self._registry.count_refusal("auth_deadline")
        log.warning(
            "closing %s from %s: not authenticated within %.0fs",
            short_id(self.peer_node_id),
            self.peer_address,
            self._config.auth_deadline,
        )
        self.close(ErrorCode.AUTH_FAILED, "not authenticated in time")

    def _cancel_auth_timer(self) -> None:
        if self._auth_timer is not None:
            self._auth_timer.cancel()
            self._auth_timer = None

    def background_tasks(self) -> list[asyncio.Task[None]]:
        """Its stream handlers and keep-alive, for a shutdown that waits for them."""
        return [*self._tasks, *([self._keepalive] if self._keepalive else [])]

    def _set_state(self, state: ConnectionState) -> None:
        if state is self.state:
            return
        peer = short_id(self.peer_node_id)
        log.debug("connection %s: %s -> %s", peer, self.state.value, state.value)
        self.state = state

    def __repr__(self) -> str:
        peer = short_id(self.peer_node_id)
        side = "out" if self.is_client else "in"
        return f"<PeerConnection {side} {peer} {self.peer_address} closed={self.is_closed}>"

    # ---- StreamHost (called by TunnelStream) ----

    def _stream_write(
        self, stream_id: int, data: bytes, end_stream: bool, defer: bool = False
    ) -> None:
        nbytes = len(data)
        if defer and end_stream and data and not self._others_held(stream_id):
            defer = False  # an End nobody else waits with goes at once: its stream is done
        if defer:
            # Held here until the flush: one aioquic write (and one STREAM frame) per stream
            # per datagram, not one per token – aioquic's bookkeeping costs per write.
            held = self._deferred.get(stream_id)
            if held is None:
                self._deferred[stream_id] = held = _Held()
            held.chunks.append(data)
            held.fin = end_stream
        else:
            held = self._deferred.pop(stream_id, None)
            if held is not None:
                held.chunks.append(data)
                data = b"".join(held.chunks)
            self._quic.send_stream_data(stream_id, data, end_stream=end_stream)
            self._send_held_fins()
        self._protocol.transmit_soon(nbytes, defer=defer)

    def _send_held_fins(self) -> None:
        """Bare FINs held for the flush (``finish()`` after a response's End) ride with a
        datagram that leaves now: they carry no data, and alone each would cost a datagram
        (and its processing at the peer) of its own, just as the next request starts."""
        fins = [sid for sid, held in self._deferred.items() if held.fin and held.chunks == [b""]]
        for stream_id in fins:
            del self._deferred[stream_id]
            try:
                self._quic.send_stream_data(stream_id, b"", end_stream=True)
            except (RuntimeError, ValueError):  # reset or finished meanwhile
                log.debug("stream %d: dropped a FIN held for a stream that ended", stream_id)

    def _others_held(self, stream_id: int) -> bool:
        """Whether streams other than ``stream_id`` wait for the next flush."""
        deferred, hooks = self._deferred, self._flush_hooks
        return len(deferred) > (stream_id in deferred) or len(hooks) > (stream_id in hooks)

    def _stream_before_flush(self, stream_id: int, callback: Callable[[], None]) -> None:
        self._flush_hooks[stream_id] = callback
        self._protocol.transmit_soon(0, defer=True)  # a flush is due, even if nothing is held

    def _flush_deferred(self) -> bool:
        """Hand the held writes to aioquic (the protocol's ``flush``): first the streams'
        ``before_flush`` callbacks write what they gathered, then every held write goes.
        False when nothing was held (a FIN that left with another datagram, a reset)."""
        if self._flush_hooks:
            hooks, self._flush_hooks = self._flush_hooks, {}
            for stream_id, hook in hooks.items():
                try:
                    hook()
                except Exception:  # a bug in one sender must not stop the others' flush
                    log.exception("stream %d: its before_flush callback failed", stream_id)
        if not self._deferred:
            return False
        deferred, self._deferred = self._deferred, {}
        for stream_id, held in deferred.items():
            try:
                self._quic.send_stream_data(stream_id, b"".join(held.chunks), held.fin)
            except (RuntimeError, ValueError):  # reset or finished meanwhile: nobody reads it
                log.debug("stream %d: dropped writes held for a stream that ended", stream_id)
        return True

    def _stream_abort(self, stream_id: int, code: int, send: bool, receive: bool) -> None:
        if send:
            self._deferred.pop(stream_id, None)
            self._flush_hooks.pop(stream_id, None)
            self._quic.reset_stream(stream_id, int(code))
        if receive:
            with contextlib.suppress(ValueError):  # never sent nor received: nothing to stop
                self._quic.stop_stream(stream_id, int(code))
        self._protocol._transmit_soon()

    def _stream_done(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)
        self._flush_hooks.pop(stream_id, None)

    def _lost_error(self) -> ConnectionLost | None:
        return self._lost

    # ---- aioquic events ----

    def handle_event(self, event: events.QuicEvent) -> None:
        handler = _EVENT_HANDLERS.get(type(event))
        if handler is not None:
            handler(self, event)

    def _on_handshake(self, event: events.HandshakeCompleted) -> None:
        try:
            self._check_peer_certificate()
        except ConnectError as exc:
            code = (
                ErrorCode.DUPLICATE_NODE
                if isinstance(exc, DuplicateNodeError)
                else ErrorCode.AUTH_FAILED
            )
            if isinstance(exc, DuplicateNodeError):
                log.error("%s", exc)
                self._registry.report_duplicate(exc)
            self._fail_handshake(exc, code)
            return
        if not self.is_client and not self._registry.admit_unauthenticated(self):
            self._fail_handshake(
                ConnectError("too many unauthenticated connections"), ErrorCode.REJECTED
            )
            return
        self._handshake_done = True
        if self.is_client:
            stream_id = self._next_stream_id
            self._next_stream_id += 4
            self.control = TunnelStream(
                self, stream_id, StreamRole.CONTROL, self._config.stream_window
            )
            self._streams[stream_id] = self.control
            self._stream_write(stream_id, encode(Window(0)), False)  # opens it at the peer
        elif self.control is not None:
            self._become_ready()

    def _check_peer_certificate(self) -> None:
        peer = verify_peer(
            peer_certificate(self._quic),
            self._registry.node_id,
            self._pin,
            self.peer_address,
        )
        self.peer_certificate = peer.certificate
        self.peer_public_key = peer.public_key
        self.peer_node_id = peer.node_id
        self.peer_cert_fingerprint = peer.cert_fingerprint

    def _on_stream_data(self, event: events.StreamDataReceived) -> None:
        stream = self._streams.get(event.stream_id)
        if stream is None:
            stream = self._accept_stream(event.stream_id)
            if stream is None:
                return
        if stream is not self.control and not self.authenticated.is_set():
            self._preauth_bytes += len(event.data)
            if self._preauth_bytes > self._config.max_preauth_bytes:
                self._registry.count_refusal("preauth_bytes")
                self.close(ErrorCode.AUTH_FAILED, "too much data before authenticating")
                return
        stream._on_data(event.data, event.end_stream)
        if stream is self.control:
            if self.is_client and not self._ready.done():
                self._become_ready()  # the server's first control bytes = it accepted us
            self._check_control()

    def _accept_stream(self, stream_id: int) -> TunnelStream | None:
        peer_bit = 0 if not self.is_client else 1
        if stream_id & 0x3 != peer_bit or stream_id <= self._highest_peer_stream:
            return None  # not a new peer bidi stream: stale data for a stream we dropped
        self._highest_peer_stream = stream_id
        window = self._config.stream_window
        if stream_id == CONTROL_STREAM_ID and not self.is_client:
            self.control = TunnelStream(self, stream_id, StreamRole.CONTROL, window)
            self._streams[stream_id] = self.control
            if self._handshake_done:
                self._become_ready()
            return self.control
        stream = TunnelStream(self, stream_id, StreamRole.REQUEST, window)
        self._streams[stream_id] = stream
        if self.authenticated.is_set():
            self._serve(stream)
        elif len(self._held) < self._config.max_held_streams:
            self._held.append(stream)
        else:
            stream.reset(ErrorCode.REJECTED)
        return stream

    def _on_reset(self, event: events.StreamReset) -> None:
        stream = self._streams.get(event.stream_id)
        if stream is not None:
            stream._on_reset(event.error_code)
            if stream is self.control:
                self._check_control()

    def _on_stop_sending(self, event: events.StopSendingReceived) -> None:
        self._deferred.pop(event.stream_id, None)  # aioquic reset our side: they cannot go
        self._flush_hooks.pop(event.stream_id, None)
        stream = self._streams.get(event.stream_id)
        if stream is not None:
            stream._on_stop_sending(event.error_code)
            if stream is self.control:
                self._check_control()

    def _check_control(self) -> None:
        """The control stream lives as long as the connection: its end is a protocol error."""
        control = self.control
        if control is not None and (control.done or control._error is not None):
            self.close(ErrorCode.PROTOCOL, f"control stream failed: {control._error or 'ended'}")

    def _on_ping_ack(self, event: events.PingAcknowledged) -> None:
        waiter = self._pings.pop(event.uid, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_terminated(self, event: events.ConnectionTerminated) -> None:
        if self._lost is None:
            reason = event.reason_phrase or error_name(event.error_code)
            if event.error_code == ErrorCode.DUPLICATE_NODE and not self._ready.done():
                exc = DuplicateNodeError(
                    f"peer at {self.peer_address} refused us, node {short_id(self._registry.node_id)}"
                    f": {event.reason_phrase or 'duplicate node id'} (a copied home dir?)"
                )
                log.error("%s", exc)
                self._registry.report_duplicate(exc)
            self._mark_lost(
                ConnectionLost(f"peer closed the connection: {reason}", event.error_code)
            )
        self._protocol.terminated()

    # ---- lifecycle ----

    def _become_ready(self) -> None:
        if self._ready.done() or self._lost is not None:
            return
        hold = self._registry.hold_for(self)
        if hold is not None:
            self._set_state(ConnectionState.HELD)
            hold.add_done_callback(lambda _done: self._become_ready())  # decide after it
            return
        refusal = self._registry.register(self)
        if refusal == ErrorCode.DUPLICATE_NODE:
            exc = DuplicateNodeError(
                f"refused {short_id(self.peer_node_id)} from {self.peer_address}: a live node "
                "with that id is already linked (a copied home dir?)"
            )
            log.error("%s", exc)
            self._fail_handshake(exc, ErrorCode.DUPLICATE_NODE)
            return
        if refusal is not None:
            self._fail_handshake(
                Superseded("simultaneous dial: kept the other connection"), ErrorCode.SUPERSEDED
            )
            return
        if not self.is_client and self.control is not None:
            self._stream_write(self.control.stream_id, encode(Window(0)), False)  # accepted
        self._set_state(ConnectionState.READY)
        self._ready.set_result(None)
        self._keepalive = self._loop.create_task(self._ping_forever())
        self._registry.announce(self)

    def _fail_handshake(self, exc: ConnectError, code: ErrorCode) -> None:
        if not self._ready.done():
            self._ready.set_exception(exc)
        # Flush our TLS Finished first: a close inside the handshake is sent as a bare
        # transport error and the peer would never see our code.
        self._protocol.transmit()
        self.close(code, str(exc)[:200])

    def _serve(self, stream: TunnelStream) -> None:
        task = self._loop.create_task(self._run_handler(stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_handler(self, stream: TunnelStream) -> None:
        handler = self.on_stream
        if handler is None:
            stream.reset(ErrorCode.REJECTED)
            return
        try:
            await handler(stream)
        except StreamLost as exc:
            log.debug("stream %d of %r lost: %s", stream.stream_id, self, exc)
        except MeshError as exc:  # e.g. the peer broke the frame protocol
            log.warning("stream %d of %r: %s", stream.stream_id, self, exc)
        except Exception:
            log.exception("stream handler failed on stream %d of %r", stream.stream_id, self)
            stream.reset(ErrorCode.INTERNAL)
        finally:
            if not stream._local_finished:
                stream.reset(ErrorCode.INTERNAL)  # the handler left without sending End

    async def _ping_forever(self) -> None:
        """Ping every ``ping_interval``; close when the peer was silent for ``ping_timeout``.

        Silence, not a lost ping, is the signal: under packet loss a ping or its ack may be
        dropped while the peer is alive, but a live peer is never silent for long."""
        interval, timeout = self._config.ping_interval, self._config.ping_timeout
        next_ping = self._loop.time()
        while self._lost is None:
            now = self._loop.time()
            if now >= next_ping:
                for stale in self._pings.values():
                    stale.cancel()  # its ack was lost or is late: no RTT sample from it
                uid = next(self._ping_ids)
                waiter = self._loop.create_future()
                waiter.add_done_callback(partial(self._ping_answered, now))
                self._pings = {uid: waiter}
                self._quic.send_ping(uid)
                self._protocol.transmit()
                next_ping = now + interval
            # Wake for the next ping or the moment the peer would have been silent too long,
            # whichever is first: detection then takes ping_timeout, not ping_timeout + a tick.
            silence_deadline = self._protocol.last_heard + timeout + _WAKE_SLACK_S
            await asyncio.sleep(max(0.0, min(next_ping, silence_deadline) - self._loop.time()))
            silent = self._loop.time() - self._protocol.last_heard
            if silent > timeout:
                log.warning("%r: peer silent for %.1fs, closing", self, silent)
                self.close(ErrorCode.PING_TIMEOUT, f"peer silent for {silent:.1f}s")
                return

    def _ping_answered(self, sent_at: float, waiter: asyncio.Future[None]) -> None:
        if waiter.cancelled():
            return
        sample = self._loop.time() - sent_at
        self.rtt = sample if self.rtt is None else 0.8 * self.rtt + 0.2 * sample

    def _mark_lost(self, error: ConnectionLost) -> None:
        self._lost = error
        self._cancel_auth_timer()
        self.close_code, self.close_reason = error.code, str(error)
        if not self._ready.done():
            err_type = _CLOSE_ERRORS.get(error.code or 0, ConnectError)
            self._ready.set_exception(err_type(f"connection failed: {error}"))
        streams, self._streams, self._held = list(self._streams.values()), {}, []
        self._deferred.clear()
        self._flush_hooks.clear()
        for stream in streams:
            stream._on_connection_lost(error)
        for waiter in self._pings.values():
            waiter.cancel()
        self._pings.clear()
        current = asyncio.current_task()
        for task in [*self._tasks, self._keepalive]:
            if task is not None and task is not current:
                task.cancel()
        self._set_state(ConnectionState.CLOSED)
        self.closed.set()
        self._registry.unregister(self)


@dataclass(slots=True)
class _Held:
    """A stream's writes waiting for the connection's next flush."""

    chunks: list[bytes] = field(default_factory=list)
    fin: bool = False


def _retrieve(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


_EVENT_HANDLERS: dict[type, Callable[[PeerConnection, Any], None]] = {
    events.HandshakeCompleted: PeerConnection._on_handshake,
    events.StreamDataReceived: PeerConnection._on_stream_data,
    events.StreamReset: PeerConnection._on_reset,
    events.StopSendingReceived: PeerConnection._on_stop_sending,
    events.PingAcknowledged: PeerConnection._on_ping_ack,
    events.ConnectionTerminated: PeerConnection._on_terminated,
}
