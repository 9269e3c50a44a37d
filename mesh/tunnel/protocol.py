"""aioquic's datagram protocol for one tunnel connection, with its events routed to a
:class:`~mesh.tunnel.connection.PeerConnection` (which owns all tunnel behaviour).

Coalescing. aioquic spends ~250 µs of Python per datagram on this project's 2-core box (build,
encrypt, send; receive, decrypt, parse; the ACK back), whatever the datagram carries, and a
token is a ~30-byte frame: one datagram per token made relaying cost ~180 µs per token. So a
write the sender marks ``defer`` (a response's frames other than its first token and ``End``)
is held by the connection, not given to aioquic, until ``flush()``: ``flush_delay`` s after
the previous one, or once ``FLUSH_BYTES`` are held. Then every held write goes to aioquic at
once – one write per stream, datagrams as full as they get. A write without ``defer``
(requests, the first token, ``End``, credit, resets) goes to aioquic and out this loop turn,
taking its own stream's held writes along first (order within a stream is kept) but leaving
the other streams' held: a busy connection starts and ends streams all the time, and each
would cut everyone's coalescing short. Only their bare FINs (a requester done with a
response) ride along: no data to coalesce, and alone each would cost a datagram. A connection whose last flush is older than
``flush_delay`` holds nothing for longer than a loop turn: a real engine's tokens come
10–150 ms apart, so none of them waits; only a connection carrying hundreds of tokens a second
coalesces, each token waiting at most ``flush_delay`` (5 ms, a third of a 60 Hz frame).
Right before a flush the streams' ``before_flush`` callbacks run: the tunnel server writes the
deltas it merged while the flush was pending (``mesh/delta_merge.py``). A deferred ``End``
waits only for a flush that other streams' writes wait for too; alone it goes at once.

Replies. aioquic's protocol transmits after every datagram received, though what one asks for
(its ACK) is due only 1 ms later; after the handshake, when aioquic's next deadline is within
``REPLY_DELAY`` (that same 1 ms), one transmit then answers all the datagrams received
meanwhile. aioquic's own sends (ACKs, pings, retransmissions) are otherwise untouched.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic import events
from aioquic.quic.connection import QuicConnection

from mesh.tunnel.connection import PeerConnection
from mesh.tunnel.neighbours import ConnectionRegistry
from mesh.tunnel.pins import Pin, request_client_certificate

# Held writes are flushed early once this much is held. Not one datagram's worth: the streams
# of a busy connection each add a STREAM frame per datagram (aioquic and our reader pay per
# frame too), so a datagram of one-token frames saves little.
FLUSH_BYTES = 16 * 1024
# The answer to a received datagram waits for aioquic's next deadline when that is this close:
# aioquic delays ACKs by 1 ms itself (K_GRANULARITY), so this adds nothing to them.
REPLY_DELAY = 0.001


class TunnelProtocol(QuicConnectionProtocol):
    """aioquic's datagram protocol, with events routed to a ``PeerConnection``."""

    def __init__(
        self,
        quic: QuicConnection,
        stream_handler: object = None,
        *,
        registry: ConnectionRegistry[PeerConnection],
        is_client: bool,
        pin: Pin | None = None,
    ) -> None:
        super().__init__(quic)
        self._registry = registry
        self._flush_delay = registry.config.flush_delay
        self._held = 0  # bytes the connection holds for the next flush
        self._last_flush = 0.0
        self._flush_timer: asyncio.TimerHandle | None = None
        self._flushing = False
        self._reply_timer: asyncio.TimerHandle | None = None
        if not is_client:
            request_client_certificate(quic)
        self.conn = PeerConnection(registry, self, is_client, pin)
        self._is_client = is_client
        self.last_heard = self._loop.time()  # any datagram from the peer proves it is alive

    @property
    def quic(self) -> QuicConnection:
        """The aioquic connection this protocol drives."""
        return self._quic

    def transmit(self) -> None:
        if self._reply_timer is not None:  # this transmit is the one it waited for
            self._reply_timer.cancel()
            self._reply_timer = None
        transport = self._transport
        if transport is None or transport.is_closing():
            # Our socket is gone (endpoint stopped, or the test killed it): let aioquic run
            # its timers to the end, but nothing can be sent any more.
            self._quic.datagrams_to_send(now=self._loop.time())
            self._transmit_task = None
            return
        super().transmit()

    def transmit_soon(self, nbytes: int, *, defer: bool) -> None:
        """``nbytes`` were written to a stream: to aioquic, to be sent this loop turn, or –
        ``defer`` – held by the connection for the next flush."""
        if not defer:
            self._transmit_soon()
            return
        if self._flushing:
            return  # a before_flush callback's write: the flush under way takes it
        self._held += nbytes
        if self._held >= FLUSH_BYTES:
            self.flush()
        elif self._flush_timer is None:
            due = max(self._last_flush + self._flush_delay, self._loop.time())
            self._flush_timer = self._loop.call_at(due, self.flush)

    def flush(self) -> None:
        """Hand every held write to aioquic and send."""
        # The streams' before_flush callbacks write what they gathered as held writes: this
        # flush takes them along (no timer, no early flush for them).
        self._flushing = True
        try:
            flushed = self.conn.flush_deferred()
        finally:
            self._flushing = False
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        self._held = 0
        if flushed:  # else what it was armed for already left (a FIN with a request)
            self._last_flush = self._loop.time()
            self.transmit()

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        now = self.last_heard = self._loop.time()
        if not self.conn.handshake_done:
            super().datagram_received(data, addr)  # the handshake answers at once
            return
        # aioquic transmits after every datagram received, though what a datagram that
        # carries frames asks for (its ACK) is due only ack_delay later: those transmits
        # send nothing and still cost aioquic a pass over every stream. When aioquic's next
        # deadline is that close (an ACK is due), one transmit then answers every datagram
        # received meanwhile (any other transmit does it sooner). A datagram that asks for
        # nothing due soon (an ACK of ours) gets its transmit now, as aioquic does: waking
        # up later just for it would cost more than it saves.
        self._quic.receive_datagram(data, addr, now=now)  # type: ignore[arg-type]
        self._process_events()
        if self._reply_timer is not None:
            return
        due = self._quic.get_timer()
        if due is not None and due <= now + REPLY_DELAY:
            self._reply_timer = self._loop.call_at(due, self.transmit)
        else:
            self.transmit()

    def quic_event_received(self, event: events.QuicEvent) -> None:
        self.conn.handle_event(event)

    def terminated(self) -> None:
        """aioquic finished closing; a dialed connection owns its UDP socket."""
        if self._flush_timer is not None:  # nothing held can be sent any more
            self._flush_timer.cancel()
            self._flush_timer = None
        if self._reply_timer is not None:
            self._reply_timer.cancel()
            self._reply_timer = None
        if self._is_client and self._transport is not None:
            self._transport.close()
        self._registry.forget(self.conn)
