"""What a ``PeerConnection`` needs from its neighbours: the table of connections it belongs to
(the endpoint), the aioquic protocol under it (``protocol.TunnelProtocol``) and the
application's handler for peer-opened streams."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from aioquic.quic.connection import QuicConnection

from mesh.errors import DuplicateNodeError
from mesh.tunnel.config import TunnelConfig
from mesh.tunnel.frames import ErrorCode

if TYPE_CHECKING:
    from mesh.tunnel.connection import PeerConnection
    from mesh.tunnel.stream import TunnelStream

StreamHandler = Callable[["TunnelStream"], Awaitable[None]]


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

    async def wait_closed(self) -> None: ...
