"""One QUIC connection to one peer: the aioquic event adapter behind ``PeerConnection``.

See ``mesh/tunnel/__init__.py`` for the API as a whole. This module turns aioquic events into tunnel
behaviour: certificate pinning and duplicate-node detection at handshake, the control stream,
holding peer streams until the connection is authenticated, keep-alive pings with a timeout,
resets surfaced to readers, and ``ConnectionLost`` for every stream when the connection dies.

A connection talks to whoever keeps the table of connections (the endpoint) only through the
small :class:`~mesh.tunnel.neighbours.ConnectionRegistry` protocol; the tie-break rules
themselves are pure (``registry.py``). What it holds back for the next flush is
``coalesce.py``'s, when to ping and when silence means death ``keepalive.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable
from typing import Any

from aioquic.quic import events
from aioquic.quic.connection import QuicConnection
from cryptography import x509

from mesh.errors import (
    AuthFailed,
    ClosedError,
    ConnectError,
    ConnectionLost,
    DuplicateNodeError,
    Superseded,
)
from mesh.identity import short_id
from mesh.tunnel.coalesce import Outbox
from mesh.tunnel.config import TunnelConfig
from mesh.tunnel.frames import ErrorCode, StreamRole, Window, encode, error_name
from mesh.tunnel.keepalive import KeepAlive, ping_until_silent, probe_alive
from mesh.tunnel.neighbours import ConnectionRegistry, QuicLink, StreamHandler
from mesh.tunnel.pins import Pin, peer_certificate, verify_peer
from mesh.tunnel.stream import TunnelStream

log = logging.getLogger(__name__)

CONTROL_STREAM_ID = 0  # the client's first bidirectional stream


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
        registry: ConnectionRegistry[PeerConnection],
        protocol: QuicLink,
        is_client: bool,
        pin: Pin | None,
    ) -> None:
        self.is_client = is_client
        self.peer_node_id: str | None = None
        self.peer_public_key: bytes | None = None
        self.peer_cert_fingerprint: str | None = None
        self.peer_certificate: x509.Certificate | None = None
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
        self._quic: QuicConnection = protocol.quic
        self._pin = pin
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[None] = self._loop.create_future()
        self._ready.add_done_callback(_retrieve)  # failures are raised to connect(), if any
        self._handshake_done = False
        self._streams: dict[int, TunnelStream] = {}
        self._outbox = Outbox(self._quic.send_stream_data)  # writes held for the next flush
        self._held: list[TunnelStream] = []
        self._tasks: set[asyncio.Task[Any]] = set()  # stream handlers and liveness probes
        self._next_stream_id = 0 if is_client else 1
        self._highest_peer_stream = -1
        self._pings = KeepAlive(self._config.ping_interval, self._config.ping_timeout)
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
    def rtt(self) -> float | None:
        """Seconds, smoothed, from the keep-alive pings; None until the first is answered."""
        return self._pings.rtt

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
    def link(self) -> QuicLink:
        """The aioquic side under it (the endpoint waits for it to close at shutdown)."""
        return self._protocol

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
        probe = probe_alive(self._pings, self._protocol, self._closed, within_s)
        task = self._loop.create_task(probe)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

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

    def background_tasks(self) -> list[asyncio.Task[Any]]:
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

    def stream_write(
        self, stream_id: int, data: bytes, end_stream: bool, defer: bool = False
    ) -> None:
        held = self._outbox.write(stream_id, data, end_stream, defer)
        self._protocol.transmit_soon(len(data), defer=held)

    def stream_before_flush(self, stream_id: int, callback: Callable[[], None]) -> None:
        self._outbox.before_flush(stream_id, callback)
        self._protocol.transmit_soon(0, defer=True)  # a flush is due, even if nothing is held

    def stream_abort(self, stream_id: int, code: int, send: bool, receive: bool) -> None:
        if send:
            self._outbox.drop(stream_id)
            self._quic.reset_stream(stream_id, int(code))
        if receive:
            with contextlib.suppress(ValueError):  # never sent nor received: nothing to stop
                self._quic.stop_stream(stream_id, int(code))
        self._protocol.transmit_soon(0, defer=False)  # the reset goes out this loop turn

    def stream_done(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)
        self._outbox.stream_done(stream_id)

    def lost_error(self) -> ConnectionLost | None:
        return self._lost

    # ---- called by TunnelProtocol ----

    def flush_deferred(self) -> bool:
        """Hand the held writes to aioquic (the protocol's ``flush``); False if none were."""
        return self._outbox.flush()

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
            self.stream_write(stream_id, encode(Window(0)), False)  # opens it at the peer
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
        stream.data_received(event.data, event.end_stream)
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
            stream.reset_received(event.error_code)
            if stream is self.control:
                self._check_control()

    def _on_stop_sending(self, event: events.StopSendingReceived) -> None:
        self._outbox.drop(event.stream_id)  # aioquic reset our side: they cannot go
        stream = self._streams.get(event.stream_id)
        if stream is not None:
            stream.stop_sending_received(event.error_code)
            if stream is self.control:
                self._check_control()

    def _check_control(self) -> None:
        """The control stream lives as long as the connection: its end is a protocol error."""
        control = self.control
        if control is not None and (control.done or control.error is not None):
            self.close(ErrorCode.PROTOCOL, f"control stream failed: {control.error or 'ended'}")

    def _on_ping_ack(self, event: events.PingAcknowledged) -> None:
        self._pings.acked(event.uid, self._loop.time())

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
            self.stream_write(self.control.stream_id, encode(Window(0)), False)  # accepted
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
        await stream.serve(handler, self)

    async def _ping_forever(self) -> None:
        """Ping on the keep-alive's timer; close once the peer was silent for too long."""
        silent = await ping_until_silent(self._pings, self._protocol, self._closed)
        if silent is not None:
            log.warning("%r: peer silent for %.1fs, closing", self, silent)
            self.close(ErrorCode.PING_TIMEOUT, f"peer silent for {silent:.1f}s")

    def _closed(self) -> bool:
        return self._lost is not None

    def _mark_lost(self, error: ConnectionLost) -> None:
        self._lost = error
        self._cancel_auth_timer()
        self.close_code, self.close_reason = error.code, str(error)
        if not self._ready.done():
            err_type = _CLOSE_ERRORS.get(error.code or 0, ConnectError)
            self._ready.set_exception(err_type(f"connection failed: {error}"))
        streams, self._streams, self._held = list(self._streams.values()), {}, []
        self._outbox.clear()
        for stream in streams:
            stream.connection_lost(error)
        self._pings.stop()
        current = asyncio.current_task()
        for task in [*self._tasks, self._keepalive]:
            if task is not None and task is not current:
                task.cancel()
        self._set_state(ConnectionState.CLOSED)
        self.closed.set()
        self._registry.unregister(self)


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
