"""aioquic's datagram protocol for one tunnel connection, with its events routed to a
:class:`~mesh.tunnel.connection.PeerConnection` (which owns all tunnel behaviour)."""

from __future__ import annotations

from typing import Any

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic import events
from aioquic.quic.connection import QuicConnection

from mesh.tunnel.connection import ConnectionRegistry, PeerConnection
from mesh.tunnel.pins import Pin, request_client_certificate


class TunnelProtocol(QuicConnectionProtocol):
    """aioquic's datagram protocol, with events routed to a ``PeerConnection``."""

    def __init__(
        self,
        quic: QuicConnection,
        stream_handler: object = None,
        *,
        registry: ConnectionRegistry,
        is_client: bool,
        pin: Pin | None = None,
    ) -> None:
        super().__init__(quic)
        if not is_client:
            request_client_certificate(quic)
        self.conn = PeerConnection(registry, self, is_client, pin)
        self._is_client = is_client
        self.last_heard = self._loop.time()  # any datagram from the peer proves it is alive

    def transmit(self) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            # Our socket is gone (endpoint stopped, or the test killed it): let aioquic run
            # its timers to the end, but nothing can be sent any more.
            self._quic.datagrams_to_send(now=self._loop.time())
            self._transmit_task = None
            return
        super().transmit()

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self.last_heard = self._loop.time()
        super().datagram_received(data, addr)

    def quic_event_received(self, event: events.QuicEvent) -> None:
        self.conn.handle_event(event)

    def terminated(self) -> None:
        """aioquic finished closing; a dialed connection owns its UDP socket."""
        if self._is_client and self._transport is not None:
            self._transport.close()
        self.conn._registry.forget(self.conn)
