"""Keep-alive: when to ping, when a peer's silence means it is dead, the RTT.

aioquic has no keep-alive of its own. :class:`KeepAlive` only decides (sans-IO, times passed
in); ``PeerConnection`` runs it through :func:`ping_until_silent` and :func:`probe_alive`, which
send the pings. Silence, not a lost ping, is the signal: under packet loss a ping or its ack may
be dropped while the peer is alive, but a live peer is never silent for long.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from mesh.tunnel.neighbours import QuicLink

# Past the silence deadline by this much when the ping loop wakes for it (timer granularity).
WAKE_SLACK_S = 0.01


class KeepAlive:
    """Ping every ``interval`` s; the peer is dead once silent for more than ``timeout`` s.

    Times are the caller's clock (the event loop's). ``rtt`` (seconds, smoothed) comes from the
    acks of the timer's pings; None until the first."""

    def __init__(self, interval: float, timeout: float) -> None:
        self.interval = interval
        self.timeout = timeout
        self.rtt: float | None = None
        self._ids = itertools.count(1)
        self._next_ping: float | None = None
        self._outstanding: dict[int, float] = {}  # ping uid → when it was sent

    def next_uid(self) -> int:
        """A ping id that no other ping of this connection has (a liveness probe's too)."""
        return next(self._ids)

    def ping_due(self, now: float) -> bool:
        return self._next_ping is None or now >= self._next_ping

    def ping(self, now: float) -> int:
        """The timer's ping goes now: its uid. An earlier one still unanswered gives no RTT
        sample any more (its ack was lost or is late)."""
        uid = self.next_uid()
        self._outstanding = {uid: now}
        self._next_ping = now + self.interval
        return uid

    def acked(self, uid: int, now: float) -> None:
        """The peer acknowledged ping ``uid``: an RTT sample if it is the timer's latest."""
        sent_at = self._outstanding.pop(uid, None)
        if sent_at is None:
            return
        sample = now - sent_at
        self.rtt = sample if self.rtt is None else 0.8 * self.rtt + 0.2 * sample

    def wake_at(self, last_heard: float) -> float:
        """When to look again: the next ping or the moment the peer would have been silent too
        long, whichever is first (detection then takes ``timeout``, not ``timeout`` + a tick)."""
        assert self._next_ping is not None, "ping() first"
        return min(self._next_ping, last_heard + self.timeout + WAKE_SLACK_S)

    def is_dead(self, silent_for: float) -> bool:
        return silent_for > self.timeout

    def stop(self) -> None:
        """The connection is gone: acks still in flight give no sample."""
        self._outstanding.clear()


async def ping_until_silent(
    keepalive: KeepAlive, link: QuicLink, closed: Callable[[], bool]
) -> float | None:
    """Ping on ``keepalive``'s timer until the peer was silent too long (how long: the caller
    closes the connection) or the connection closed (None)."""
    loop = asyncio.get_running_loop()
    while not closed():
        now = loop.time()
        if keepalive.ping_due(now):
            link.quic.send_ping(keepalive.ping(now))
            link.transmit()
        await asyncio.sleep(max(0.0, keepalive.wake_at(link.last_heard) - loop.time()))
        silent = loop.time() - link.last_heard
        if keepalive.is_dead(silent):
            return silent
    return None


async def probe_alive(
    keepalive: KeepAlive,
    link: QuicLink,
    closed: Callable[[], bool],
    within_s: float,
) -> bool:
    """Ping now; True once anything is heard from the peer, False when ``within_s`` passes
    first (or the connection closes)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    link.quic.send_ping(keepalive.next_uid())  # its ack (or anything else) proves life
    link.transmit()
    while not closed() and loop.time() - start < within_s:
        if link.last_heard > start:
            return True
        await asyncio.sleep(0.01)
    return False
