"""aioquic's datagram protocol for one tunnel connection, with its events routed to a
:class:`~mesh.tunnel.connection.PeerConnection` (which owns all tunnel behaviour).

Coalescing. aioquic spends ~250 µs of Python per datagram on this project's 2-core box (build,
encrypt, send; receive, decrypt, parse; the ACK back), whatever the datagram carries, while a
token is a 46-byte frame: one datagram per token made relaying cost ~180 µs per token. So
writes the sender marks ``defer`` (a response's frames other than its first token and ``End``)
are held by the connection and leave together – one aioquic write per stream, datagrams as
full as they get – ``flush_delay`` s after the previous flush, or once ``FLUSH_BYTES`` wait.
Every other write (requests, the first token, ``End``, credit, resets) flushes at once and
takes the held ones along, and so does any send aioquic makes (an ACK, a ping). A connection
whose last flush is older than ``flush_delay`` holds nothing: a real engine's tokens come
10–150 ms apart, so none of them waits; only a connection carrying hundreds of tokens a second
coalesces, each token waiting at most ``flush_delay`` (5 ms, a third of a 60 Hz frame). While
a flush is held, a datagram from the peer does not trigger a send of its own: a plain ACK
needs no answer, and one that does (a ping, credit, a request) gets it when aioquic's ACK
timer fires, on time.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic import events
from aioquic.quic.connection import QuicConnection

from mesh.tunnel.connection import ConnectionRegistry, PeerConnection
from mesh.tunnel.pins import Pin, request_client_certificate

# Held writes are flushed early once this much waits. Not one datagram's worth: the streams
# of a busy connection each add a STREAM frame per datagram (aioquic and our reader pay per
# frame too), so a datagram of one-token frames saves little; bulk never waits for the timer.
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
        # A flush is held: sending now, as aioquic does after every datagram, would cut it
        # short at the peer's next ACK – about one a millisecond while tokens flow. Only
        # aioquic's timer is brought up to date, so an ACK this datagram calls for (it was
        # a ping, credit, a request) still leaves on time, with the held writes.
        self._quic.receive_datagram(data, addr, now=now)  # type: ignore[arg-type]
        self._process_events()
        self._rearm_timer()

    def _rearm_timer(self) -> None:
        """The timer half of aioquic's ``transmit()``, without sending."""
        timer_at = self._quic.get_timer()
        if self._timer is not None and self._timer_at != timer_at:
            self._timer.cancel()
            self._timer = None
        if self._timer is None and timer_at is not None:
            self._timer = self._loop.call_at(timer_at, self._handle_timer)
        self._timer_at = timer_at

    def quic_event_received(self, event: events.QuicEvent) -> None:
        self.conn.handle_event(event)

    def terminated(self) -> None:
        """aioquic finished closing; a dialed connection owns its UDP socket."""
        if self._is_client and self._transport is not None:
            self._transport.close()
        self.conn._registry.forget(self.conn)
