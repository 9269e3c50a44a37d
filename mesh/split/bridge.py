"""Ring traffic between machines over TLS 1.3 with both node certificates pinned.

MLX's ring backend opens plain, unauthenticated TCP connections to the addresses in its
hostfile. So every rank listens on loopback only, and a rank on another node is reached through
a bridge: on each node a :class:`BridgeLink` per remote rank listens on ``127.0.0.1`` (that is
the address the local hostfile gives for the remote rank) and carries each connection, over TLS
(this node's certificate presented, only the remote node's trusted), to the remote node's
:class:`BridgeServer`, which checks the caller is a member, reads which rank of which group it
wants, and connects it to that rank's loopback port. A stranger, or a member asking for a rank
that is not registered, gets nothing but a closed connection; the server never dials a port
that was not registered for a group.

Wire: after the TLS handshake the link sends one line ``ring <group> <rank>\\n``; then bytes
flow both ways unchanged until either side closes. ``TCP_NODELAY`` everywhere: a decode step
is a few small messages, and Nagle's algorithm would hold each for a round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import ssl
from collections.abc import Callable, Iterable

from cryptography.x509 import load_der_x509_certificate

from mesh.copy.tls import make_context, peer_node_id
from mesh.errors import AuthFailed
from mesh.identity import NodeIdentity, node_id_of_cert

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0  # TLS handshake and the header line, per connection
RANK_LISTEN_TIMEOUT_S = 120.0  # a forming group's rank may still be loading before it listens
ROUTE_WAIT_S = 120.0  # a member's link may come before its rank's node registered the rank
_HEADER = re.compile(rb"^ring ([A-Za-z0-9._-]{1,64}) (\d{1,4})\n$")
_CHUNK = 1 << 16


class _Listener:
    """A loopback or LAN listener that tracks its connection tasks, so that ``close()`` ends
    every connection it accepted (no leaked task). Subclasses say how one connection is served
    in ``_serve``; the accepted writer is closed here whatever ``_serve`` does."""

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._ended: set[asyncio.Task[None]] = set()  # connections this side ended on purpose
        self._closing = False
        self.port = 0

    async def _listen(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._accept, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:
            # close() or drop_member() ended it: an expected end. A connection task that ends
            # cancelled makes asyncio's stream callback log a full traceback, so it ends normally.
            if not (self._closing or task in self._ended):
                raise
            log.info("bridge: a connection ended by this node")
        finally:
            self._tasks.discard(task)
            self._ended.discard(task)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class BridgeServer(_Listener):
    """The node's side that remote ranks' links dial: members only, registered ranks only.

    ``trusted()`` returns the DER certificates of the current members (read per connection, so
    a removed member is refused from then on); ``register(group, rank, port)`` says which
    loopback port serves that rank of that group on this node."""

    def __init__(self, identity: NodeIdentity, trusted: Callable[[], Iterable[bytes]]) -> None:
        super().__init__()
        self.identity = identity
        self._trusted = trusted
        self._routes: dict[tuple[str, int], int] = {}
        self._registered = asyncio.Event()  # set (and replaced) on each registration
        self._by_member: dict[str, set[asyncio.Task[None]]] = {}

    def drop_member(self, node_id: str) -> int:
        """A member was removed: end its connections now (one opened before the removal must
        not keep piping). Returns how many were open."""
        tasks = self._by_member.pop(node_id, set())
        for task in tasks:
            self._ended.add(task)
            task.cancel()
        if tasks:
            log.warning("bridge: closed %d connection(s) of removed %s", len(tasks), node_id[:12])
        return len(tasks)

    def register(self, group: str, rank: int, port: int) -> None:
        self._routes[(group, rank)] = port
        self._registered.set()
        self._registered = asyncio.Event()

    async def _route(self, group: str, rank: int) -> int | None:
        """The rank's port; a member's link may arrive before that rank's node registered it
        (the ranks of a forming group start on their nodes at about the same time), and a
        connection refused then would hang the ring's set-up, so it waits a while."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ROUTE_WAIT_S):
                while (group, rank) not in self._routes:
                    await self._registered.wait()
        return self._routes.get((group, rank))

    def unregister(self, group: str) -> None:
        self._routes = {k: v for k, v in self._routes.items() if k[0] != group}

    async def start(self, host: str, port: int = 0) -> int:
        return await self._listen(host, port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _nodelay(writer)
        context = make_context(self.identity, self._trusted(), server=True)
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                await writer.start_tls(context)
                peer = peer_node_id(writer.get_extra_info("ssl_object"))
                header = await reader.readline()
        except (ssl.SSLError, AuthFailed, TimeoutError, ConnectionError, OSError) as exc:
            log.info("bridge: refused a connection (%s)", type(exc).__name__)
            return
        task = asyncio.current_task()
        assert task is not None
        # Counted as the member's from here: a removal while it waits for its rank ends it too.
        self._by_member.setdefault(peer, set()).add(task)
        try:
            await self._serve_member(peer, header, reader, writer)
        finally:
            self._by_member.get(peer, set()).discard(task)

    async def _serve_member(
        self,
        peer: str,
        header: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        match = _HEADER.match(header)
        port = await self._route(match[1].decode(), int(match[2])) if match else None
        if port is None:
            log.warning("bridge: member %s asked for an unknown rank %r", peer[:8], header[:80])
            return
        if not self._is_member(peer):  # the wait may be long: still a member after it?
            log.warning("bridge: %s is no longer a member; not connected to its rank", peer[:12])
            return
        try:
            local_reader, local_writer = await _dial_rank(port)
        except (OSError, TimeoutError) as exc:
            log.warning("bridge: rank port %d did not answer (%s)", port, exc)
            return
        _nodelay(local_writer)
        await _pipe(reader, writer, local_reader, local_writer)

    def _is_member(self, node_id: str) -> bool:
        return any(
            node_id_of_cert(load_der_x509_certificate(der)) == node_id for der in self._trusted()
        )


class BridgeLink(_Listener):
    """One remote rank, reachable at ``127.0.0.1:port`` on this node (the hostfile's address
    for it): each connection goes over TLS to the remote node's bridge, pinned to its cert."""

    def __init__(
        self,
        identity: NodeIdentity,
        remote: tuple[str, int],
        remote_cert: bytes,
        remote_node_id: str,
        group: str,
        rank: int,
    ) -> None:
        super().__init__()
        self.identity = identity
        self.remote = remote
        self.remote_node_id = remote_node_id
        self.header = f"ring {group} {rank}\n".encode()
        self._context = make_context(identity, [remote_cert], server=False)

    async def start(self) -> int:
        return await self._listen("127.0.0.1", 0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _nodelay(writer)
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                remote_reader, remote_writer = await asyncio.open_connection(
                    *self.remote, ssl=self._context, server_hostname=""
                )
                if peer_node_id(remote_writer.get_extra_info("ssl_object")) != (
                    self.remote_node_id
                ):
                    raise AuthFailed("the bridge answered with another node's certificate")
                remote_writer.write(self.header)
                await remote_writer.drain()
        except (OSError, TimeoutError, ssl.SSLError, AuthFailed) as exc:
            log.warning("bridge: cannot reach %s:%d (%s)", *self.remote, exc)
            return
        _nodelay(remote_writer)
        await _pipe(reader, writer, remote_reader, remote_writer)


async def _dial_rank(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to a local rank's ring port, waiting for it to listen. While a group forms the
    ring dials its peers before they all listen and retries on a refusal; through a bridge the
    dial has already succeeded (the link accepted it), so the bridge must do the waiting: a
    connection accepted and then closed leaves the ring's set-up hanging."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RANK_LISTEN_TIMEOUT_S
    while True:
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                return await asyncio.open_connection("127.0.0.1", port)
        except ConnectionRefusedError:
            if loop.time() >= deadline:
                raise
            await asyncio.sleep(0.05)


async def _pipe(
    a_reader: asyncio.StreamReader,
    a_writer: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader,
    b_writer: asyncio.StreamWriter,
) -> None:
    """Copy both ways until either side ends; then close both (the ring treats a closed
    connection as a lost peer, which the step deadline and the supervisor handle)."""

    async def copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()

    tasks = [
        asyncio.create_task(copy(a_reader, b_writer)),
        asyncio.create_task(copy(b_reader, a_writer)),
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in (a_writer, b_writer):
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await writer.wait_closed()


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
