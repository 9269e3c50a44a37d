"""The tunnel endpoint: a UDP listener plus outgoing connections, one per peer pair.

See the package docstring (``mesh/tunnel/__init__.py``) for the API as a whole.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from aioquic.asyncio.server import QuicServer, serve
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from mesh.errors import ConnectError, DuplicateNodeError, Superseded
from mesh.identity import NodeIdentity, short_id
from mesh.tunnel.config import ALPN, DEFAULT_PORT, TunnelConfig
from mesh.tunnel.connection import PeerConnection
from mesh.tunnel.frames import ErrorCode
from mesh.tunnel.pins import Pin
from mesh.tunnel.protocol import TunnelProtocol
from mesh.tunnel.registry import Link, Verdict, decide, needs_probe, waits_for_own_dial
from mesh.tunnel.registry import stale_after as stale_after_for

log = logging.getLogger(__name__)

ConnectionHandler = Callable[[PeerConnection], Awaitable[None]]


class TunnelEndpoint:
    """This node's tunnel: a UDP listener plus outgoing connections, one per peer."""

    def __init__(
        self,
        identity: NodeIdentity,
        host: str = "0.0.0.0",
        port: int = DEFAULT_PORT,
        *,
        config: TunnelConfig | None = None,
    ) -> None:
        self.identity = identity
        self.host = host
        self.port = port
        self.config = config or TunnelConfig()
        self.on_connection: ConnectionHandler | None = None
        self.on_duplicate_node: Callable[[DuplicateNodeError], None] | None = None
        self._server: QuicServer | None = None
        self._by_node: dict[str, PeerConnection] = {}
        self._all: set[PeerConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._registered = asyncio.Event()  # set and replaced on every registration
        self._dials: dict[Pin, asyncio.Future[PeerConnection]] = {}
        self._closing = False
        self.refusals: Counter[str] = Counter()  # strangers turned away, by reason
        self._probes: dict[PeerConnection, asyncio.Future[bool]] = {}  # rival → probe of the old

    # ---- lifecycle ----

    async def start(self) -> None:
        """Listen on ``host:port`` (UDP). With port 0, ``self.port`` is the bound port after."""
        self._server = await serve(
            self.host,
            self.port,
            configuration=self._quic_config(is_client=False),
            create_protocol=self._server_protocol,
        )
        sockname = self._server._transport.get_extra_info("sockname")  # type: ignore[union-attr]
        self.port = sockname[1]
        log.info(
            "tunnel listening on %s:%d (node %s)", self.host, self.port, self.identity.short_id
        )

    async def close(self) -> None:
        """Close every connection (SHUTDOWN), wait up to ``close_grace`` s, stop listening."""
        self._closing = True
        conns = list(self._all)
        for conn in conns:
            conn.close(ErrorCode.SHUTDOWN, "node shutting down")
        tasks = [*self._tasks]
        for conn in conns:
            tasks += conn.background_tasks()
        tasks = [t for t in tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # let them unwind: no leaked tasks
        pending = [c.link.wait_closed() for c in conns]
        if pending:
            _, not_done = await asyncio.wait(
                [asyncio.ensure_future(p) for p in pending], timeout=self.config.close_grace
            )
            for fut in not_done:
                fut.cancel()
        for conn in conns:
            conn.link.terminated()
        if self._server is not None:
            self._server.close()
            self._server = None

    # ---- connections ----

    @property
    def connections(self) -> list[PeerConnection]:
        """Live, registered connections (one per peer)."""
        return [c for c in self._by_node.values() if not c.is_closed]

    def connection_for(self, node_id: str) -> PeerConnection | None:
        conn = self._by_node.get(node_id)
        return conn if conn is not None and not conn.is_closed else None

    async def connect(
        self,
        host: str,
        port: int,
        *,
        expected_fingerprint: str | None = None,
        expected_node_id: str | None = None,
    ) -> PeerConnection:
        """Dial a peer, pinned by certificate fingerprint and/or node id; reuse a live one.

        Raises ``AuthFailed`` (pin mismatch / refused), ``DuplicateNodeError``, or
        ``ConnectError`` (unreachable, handshake timeout, ...)."""
        if not expected_fingerprint and not expected_node_id:
            raise ValueError("connect() needs expected_fingerprint or expected_node_id")
        if self._closing:
            raise ConnectError("endpoint is closed")
        pin = Pin(
            expected_fingerprint.lower() if expected_fingerprint else None,
            expected_node_id.lower() if expected_node_id else None,
        )
        existing = self._find(pin)
        if existing is not None:
            return existing
        # Concurrent connects to one peer share a single dial: two dials from the same side
        # would make the acceptor replace the first (it must, for a peer that restarted).
        dial = self._dials.get(pin)
        if dial is None:
            dial = asyncio.ensure_future(self._dial(host, port, pin))
            self._dials[pin] = dial
            dial.add_done_callback(lambda fut: self._dial_done(pin, fut))
        try:
            return await asyncio.shield(dial)
        except ConnectError:
            # The peer's own dial, held while ours was under way, was registered when ours
            # failed (e.g. we dialed the old address of a peer that restarted elsewhere).
            held = self._find(pin)
            if held is None:
                raise
            return held

    def _dial_done(self, pin: Pin, dial: asyncio.Future[PeerConnection]) -> None:
        self._dials.pop(pin, None)
        if not dial.cancelled():
            dial.exception()  # retrieved: every caller may have been cancelled meanwhile

    async def _dial(self, host: str, port: int, pin: Pin) -> PeerConnection:
        addr = await self._resolve(host, port)
        loop = asyncio.get_running_loop()
        local = ("::", 0) if len(addr) == 4 else ("0.0.0.0", 0)
        try:
            _, protocol = await loop.create_datagram_endpoint(
                lambda: TunnelProtocol(
                    QuicConnection(configuration=self._quic_config(is_client=True)),
                    registry=self,
                    is_client=True,
                    pin=pin,
                ),
                local_addr=local,
            )
        except OSError as exc:
            raise ConnectError(f"cannot open a UDP socket: {exc}") from exc
        conn = protocol.conn
        self._all.add(conn)
        protocol.connect(addr)
        try:
            async with asyncio.timeout(self.config.handshake_timeout):
                await conn.wait_ready()
        except asyncio.CancelledError:
            conn.close(ErrorCode.CANCELLED, "dial cancelled")
            raise
        except TimeoutError:
            conn.close(ErrorCode.CANCELLED, "handshake timed out")
            raise ConnectError(f"no answer from {host}:{port} (handshake timed out)") from None
        except Superseded:
            winner = await self._await_registered(conn.peer_node_id)
            if winner is None:
                raise ConnectError(
                    f"simultaneous dial to {host}:{port} left no connection"
                ) from None
            return winner
        return conn

    def _find(self, pin: Pin) -> PeerConnection | None:
        for conn in self.connections:
            if pin.node_id and conn.peer_node_id == pin.node_id.lower():
                return conn
            if pin.fingerprint and conn.peer_cert_fingerprint == pin.fingerprint.lower():
                return conn
        return None

    async def _await_registered(self, node_id: str | None) -> PeerConnection | None:
        if node_id is None:
            return None
        # The winning connection, if the peer is dialing us too, is at most a handshake away;
        # if it never comes (the peer kept an old connection we do not have) fail soon.
        try:
            async with asyncio.timeout(min(self.config.handshake_timeout, 3.0)):
                while (conn := self.connection_for(node_id)) is None:
                    await self._registered.wait()
                await conn.wait_ready()
        except TimeoutError:
            return None
        return conn

    @staticmethod
    async def _resolve(host: str, port: int) -> tuple[Any, ...]:
        """The peer's socket address; IPv6 keeps the 4-tuple the socket will report back,
        so aioquic recognises replies as coming from the same network path."""
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        except OSError as exc:
            raise ConnectError(f"cannot resolve {host}: {exc}") from exc
        return tuple(infos[0][4])

    # ---- the ConnectionRegistry a PeerConnection talks to ----

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    def register(self, conn: PeerConnection) -> ErrorCode | None:
        """Make ``conn`` THE connection to its peer; else the code to refuse it with."""
        assert conn.peer_node_id is not None
        self._all.add(conn)
        existing = self.connection_for(conn.peer_node_id)
        if existing is conn:
            existing = None
        probe = self._probes.pop(conn, None)
        answered = probe is not None and not probe.cancelled() and probe.result()
        decision = decide(
            self._link(existing, answered_probe=answered) if existing is not None else None,
            self._link(conn),
            stale_after=self.stale_after(),
        )
        if decision.verdict is Verdict.DUPLICATE:
            self.count_refusal("duplicate_node")
            return ErrorCode.DUPLICATE_NODE
        if decision.verdict is Verdict.REFUSE:
            return ErrorCode.SUPERSEDED
        if existing is not None:
            log.info("replacing connection to %s: %s", short_id(conn.peer_node_id), decision.why)
            existing.close(ErrorCode.SUPERSEDED, f"replaced: {decision.why}")
        self._by_node[conn.peer_node_id] = conn
        self._notify_registered()
        return None

    def stale_after(self) -> float:
        return stale_after_for(self.config.ping_interval)

    def hold_for(self, incoming: PeerConnection) -> asyncio.Future[Any] | None:
        return self._own_dial_to(incoming) or self._duplicate_probe(incoming)

    def _duplicate_probe(self, incoming: PeerConnection) -> asyncio.Future[bool] | None:
        """A probe of the connection ``incoming`` would replace, when only its answer can tell
        a restarted peer from a copied home dir (``registry.needs_probe``); once per rival."""
        if incoming in self._probes or incoming.peer_node_id is None:
            return None
        existing = self.connection_for(incoming.peer_node_id)
        if existing is None or existing is incoming:
            return None
        if not needs_probe(
            self._link(existing), self._link(incoming), stale_after=self.stale_after()
        ):
            return None
        probe = existing.probe_alive(self.stale_after())
        self._probes[incoming] = probe
        return probe

    def _own_dial_to(self, incoming: PeerConnection) -> asyncio.Future[PeerConnection] | None:
        """Our unfinished dial to the peer behind ``incoming``, if it must wait for it
        (``registry.waits_for_own_dial``). Dials are tracked from ``connect()`` on, before their
        socket exists."""
        peer = incoming.peer_node_id
        if not waits_for_own_dial(self.node_id, peer, incoming=not incoming.is_client):
            return None
        for pin, dial in self._dials.items():
            if dial.done():
                continue
            if (pin.node_id or "").lower() == peer or (
                pin.fingerprint or ""
            ).lower() == incoming.peer_cert_fingerprint:
                return dial
        return None

    def _link(self, conn: PeerConnection, *, answered_probe: bool = False) -> Link:
        initiator = self.node_id if conn.is_client else (conn.peer_node_id or "")
        address = conn.peer_address
        return Link(
            initiator=initiator,
            silent_for=conn.silent_for,
            address=f"{address[0]}:{address[1]}" if address else None,
            answered_probe=answered_probe,
        )

    def unregister(self, conn: PeerConnection) -> None:
        if conn.peer_node_id is not None and self._by_node.get(conn.peer_node_id) is conn:
            del self._by_node[conn.peer_node_id]

    def announce(self, conn: PeerConnection) -> None:
        handler = self.on_connection
        if handler is None:
            return
        task = asyncio.get_running_loop().create_task(self._run_on_connection(handler, conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_on_connection(self, handler: ConnectionHandler, conn: PeerConnection) -> None:
        try:
            await handler(conn)
        except Exception:
            log.exception("on_connection handler failed for %r", conn)
            conn.close(ErrorCode.INTERNAL, "connection handler failed")

    def report_duplicate(self, exc: DuplicateNodeError) -> None:
        if self.on_duplicate_node is not None:
            self.on_duplicate_node(exc)

    def _notify_registered(self) -> None:
        event, self._registered = self._registered, asyncio.Event()
        event.set()

    def admit_unauthenticated(self, conn: PeerConnection) -> bool:
        waiting = [c for c in self._unauthenticated() if c is not conn and c.handshake_done]
        host = conn.peer_address[0] if conn.peer_address else None
        if sum(1 for c in waiting if c.peer_address and c.peer_address[0] == host) >= (
            self.config.max_preauth_per_address
        ):
            self.count_refusal("preauth_per_address")
            return False
        if len(waiting) >= self.config.max_preauth_total:
            self.count_refusal("preauth_total")
            return False
        return True

    def count_refusal(self, reason: str) -> None:
        self.refusals[reason] += 1

    def _unauthenticated(self) -> list[PeerConnection]:
        return [
            c
            for c in self._all
            if not c.is_client and not c.is_closed and not c.authenticated.is_set()
        ]

    def forget(self, conn: PeerConnection) -> None:
        """aioquic finished closing ``conn``: drop the last reference."""
        self._all.discard(conn)
        self._probes.pop(conn, None)

    # ---- aioquic plumbing ----

    def _server_protocol(
        self, quic: QuicConnection, stream_handler: object = None
    ) -> TunnelProtocol:
        protocol = TunnelProtocol(quic, registry=self, is_client=False)
        self._all.add(protocol.conn)
        # Before TLS even completes: a flood of new connections is refused at once (each costs
        # a handshake's work and memory); the per-address cap waits for the peer's address.
        if len(self._unauthenticated()) > 2 * self.config.max_preauth_total:
            self.count_refusal("preauth_total")
            # After aioquic has read the first packet, so the close reaches the stranger.
            asyncio.get_running_loop().call_soon(
                protocol.conn.close, ErrorCode.REJECTED, "too many unauthenticated connections"
            )
        return protocol

    def _quic_config(self, *, is_client: bool) -> QuicConfiguration:
        config = QuicConfiguration(
            is_client=is_client,
            alpn_protocols=[ALPN],
            max_datagram_size=self.config.max_datagram_size,
            idle_timeout=self.config.idle_timeout,
            verify_mode=ssl.CERT_NONE,  # self-signed by design: PeerConnection pins instead
        )
        config.certificate = self.identity.certificate
        config.private_key = self.identity.private_key
        if is_client:
            config.server_name = "mlx-mesh"
        return config
