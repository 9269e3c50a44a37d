"""The connections this node opens: to its inviter with a join token, and to a member by node id
(the dialer's way in). Each is pinned (the invite's certificate, or the member's node id) and
becomes a link once the membership handshake, which the service runs on every new connection,
accepts it; these wait for that outcome."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from mesh.addresses import split_address
from mesh.admission import Admission
from mesh.errors import AddressError, ConnectError, MembershipError
from mesh.identity import short_id
from mesh.membership.invite import InviteToken
from mesh.tunnel.connection import PeerConnection
from mesh.tunnel.endpoint import TunnelEndpoint

log = logging.getLogger(__name__)


@dataclass
class Connector:
    endpoint: TunnelEndpoint
    admission: Admission
    auth_timeout_s: float

    async def join(self, token: InviteToken) -> None:
        """Join the mesh through the token's inviter, trying each of its addresses; raises
        ``MembershipError`` with every address's reason when none let us in."""
        self.admission.join = token
        problems: list[str] = []
        try:
            for address in token.addresses:
                try:
                    host, port = split_address(address)
                    conn = await self.endpoint.connect(
                        host,
                        port,
                        expected_fingerprint=token.fingerprint,
                        expected_node_id=token.inviter,
                    )
                except (ConnectError, AddressError) as exc:
                    problems.append(f"{address}: {exc}")
                    continue
                if await self.wait_link(conn) and self.admission.credentials is not None:
                    log.info("joined mesh %s through %s", token.mesh_id, short_id(token.inviter))
                    return
                problems.append(f"{address}: {self.admission.refusal or conn.close_reason}")
        finally:
            self.admission.join = None
        raise MembershipError("could not join the mesh: " + "; ".join(problems))

    async def dial_member(self, node_id: str, host: str, port: int) -> bool:
        """The dialer's way in: connect pinned by node id, then wait for the membership check."""
        try:
            conn = await self.endpoint.connect(host, port, expected_node_id=node_id)
        except ConnectError as exc:
            log.debug("dial %s at %s:%d: %s", short_id(node_id), host, port, exc)
            return False
        return await self.wait_link(conn)

    async def wait_link(self, conn: PeerConnection) -> bool:
        """Wait until ``conn`` is authenticated (True) or closed (False)."""
        waits = [
            asyncio.ensure_future(conn.authenticated.wait()),
            asyncio.ensure_future(conn.closed.wait()),
        ]
        try:
            async with asyncio.timeout(self.auth_timeout_s + 1):
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            return False
        finally:
            for waiter in waits:
                waiter.cancel()
        return conn.authenticated.is_set() and not conn.is_closed
