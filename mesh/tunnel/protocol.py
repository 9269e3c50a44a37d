"""aioquic's datagram protocol for one tunnel connection, with its events routed to a
:class:`~mesh.tunnel.connection.PeerConnection` (which owns all tunnel behaviour).

Coalescing: every datagram costs aioquic ~50 µs of Python on each side (build, encrypt, send;
receive, decrypt, parse, and an ACK back), whatever it carries. A token is ~40 bytes, so one
datagram per token makes the tunnel's CPU cost per token that of a whole datagram. Writes the
sender marks as deferrable (a response's token frames after its first) therefore wait until
``flush_delay`` s after the previous flush (or until ``FLUSH_BYTES`` wait), and then leave
together. Everything else – heads, the first token, ``End``, credit, resets – is sent at
once, and so is a token of a stream that has been quiet for ``flush_delay`` (a real engine's
tokens come tens of milliseconds apart: none of them waits).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic import events
from aioquic.quic.connection import QuicConnection

from mesh.tunnel.connection import ConnectionRegistry, PeerConnection
from mesh.tunnel.pins import Pin, request_client_certificate

# Deferred writes are flushed early once this much waits. Not one datagram's worth: the
# streams of a busy connection each add a frame per datagram (a cost of its own, per stream),
# so a datagram full of one-token frames is no saving; bulk transfers do not wait for the timer.
FLUSH_BYTES = 16 * 1024


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
        self._flush_delay = registry.config.flush_delay
        self._unsent = 0  # bytes written since the last flush
        self._last_flush = 0.0
        if not is_client:
            request_client_certificate(quic)
        self.conn = PeerConnection(registry, self, is_client, pin)
        self._is_client = is_client
        self.last_heard = self._loop.time()  # any datagram from the peer proves it is alive

    def transmit(self) -> None:
        task = self._transmit_task
        if isinstance(task, asyncio.TimerHandle):  # a deferred flush: this one carries it
            task.cancel()
        transport = self._transport
        if transport is None or transport.is_closing():
            # Our socket is gone (endpoint stopped, or the test killed it): let aioquic run
            # its timers to the end, but nothing can be sent any more.
            self._quic.datagrams_to_send(now=self._loop.time())
            self._transmit_task = None
            return
        if self._unsent:
            self._unsent = 0
            self._last_flush = self._loop.time()
        self.conn._flush_deferred()
        super().transmit()

    def transmit_soon(self, nbytes: int, *, defer: bool) -> None:
        """``nbytes`` were written to a stream: send them this loop turn, or – ``defer`` –
        with the writes of up to ``flush_delay`` s after the previous flush."""
        self._unsent += nbytes
        task = self._transmit_task
        if not defer or self._unsent >= FLUSH_BYTES:
            if isinstance(task, asyncio.TimerHandle):  # a deferred flush: bring it forward
                task.cancel()
                self._transmit_task = None
            self._transmit_soon()
            return
        if task is not None:
            return  # a flush is already due; this write goes with it
        due = self._last_flush + self._flush_delay
        if due <= self._loop.time():
            self._transmit_soon()
        else:
            self._transmit_task = self._loop.call_at(due, self.transmit)

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self.last_heard = now = self._loop.time()
        if not isinstance(self._transmit_task, asyncio.TimerHandle):
            super().datagram_received(data, addr)
            return
        # A deferred flush is due within flush_delay: what this datagram calls for (an ACK,
        # credit) goes with it. Sending now would cut every deferral short at the peer's
        # next ACK – about one per millisecond while tokens flow.
        self._quic.receive_datagram(data, addr, now=now)  # type: ignore[arg-type]
        self._process_events()

    def quic_event_received(self, event: events.QuicEvent) -> None:
        self.conn.handle_event(event)

    def terminated(self) -> None:
        """aioquic finished closing; a dialed connection owns its UDP socket."""
        if self._is_client and self._transport is not None:
            self._transport.close()
        self.conn._registry.forget(self.conn)
