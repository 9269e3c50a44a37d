"""What a ``PeerConnection`` needs from its neighbours: the table of connections it belongs to
(the endpoint), the aioquic protocol under it (``protocol.TunnelProtocol``) and the
application's handler for peer-opened streams.

The registry is generic over the connection it keeps (``ConnectionRegistry[PeerConnection]``),
so this module names nothing of ``connection.py``, which imports it: no import circle, not even
one for type checking. Every member here is public: the neighbours call nothing private of
each other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from aioquic.quic.connection import QuicConnection

from mesh.errors import DuplicateNodeError
from mesh.tunnel.config import TunnelConfig
from mesh.tunnel.frames import ErrorCode
from mesh.tunnel.stream import TunnelStream

StreamHandler = Callable[[TunnelStream], Awaitable[None]]

# The connection a registry keeps; only ever passed in (a connection hands over itself).
ConnT = TypeVar("ConnT", contravariant=True)


class ConnectionRegistry(Protocol[ConnT]):
    """What a connection needs from the table of connections it belongs to (the endpoint)."""

    @property
    def node_id(self) -> str: ...  # ours

    @property
    def config(self) -> TunnelConfig: ...

    def hold_for(self, incoming: ConnT) -> asyncio.Future[Any] | None:
        """What ``incoming`` must wait for before it may register (our own dial to the same
        peer, or a liveness probe of the connection it would replace), if anything."""

    def register(self, conn: ConnT) -> ErrorCode | None:
        """Make ``conn`` THE connection to its peer; else the code to close it with
        (SUPERSEDED: the other connection wins the tie; DUPLICATE_NODE: a copied home dir)."""

    def announce(self, conn: ConnT) -> None:
        """``conn`` is ready: hand it to the application."""

    def unregister(self, conn: ConnT) -> None:
        """``conn`` died: it is no longer the connection to its peer."""

    def forget(self, conn: ConnT) -> None:
        """aioquic finished closing ``conn``: drop the last reference."""

    def report_duplicate(self, exc: DuplicateNodeError) -> None:
        """The peer has our own node id (a copied home dir)."""

    def admit_unauthenticated(self, conn: ConnT) -> bool:
        """Whether one more not-yet-authenticated connection from its address may wait."""

    def count_refusal(self, reason: str) -> None:
        """A stranger was turned away (for metrics)."""


class QuicLink(Protocol):
    """The aioquic side of one connection (``protocol.TunnelProtocol``)."""

    last_heard: float  # loop time of the last datagram from the peer

    @property
    def quic(self) -> QuicConnection:
        """The aioquic connection: the connection writes its streams and pings into it."""

    def transmit(self) -> None:
        """Send what aioquic has to send, now."""

    def transmit_soon(self, nbytes: int, *, defer: bool) -> None:
        """``nbytes`` were written: send this loop turn, or (``defer``) at the next flush."""

    def terminated(self) -> None:
        """aioquic finished closing (or the endpoint gave up waiting): release the link."""

    async def wait_closed(self) -> None: ...
