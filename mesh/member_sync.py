"""Members keeping each other up to date on their links: the member facts and the mesh secret.

* **Facts** (:class:`~mesh.gossip.Members`): every link starts with ours; a change (a join, a
  removal, facts a peer brought) goes to every link; and a peer whose gossiped digest differs
  from ours is sent ours again (at most once per ``RESEND_S``), so members that missed a change
  converge. The nodes a merge drops are cut off at once; refused facts are counted and logged.
* **The mesh secret**: the node that removes a member rotates it once the removed nodes are cut
  off, and sends it (``Control(kind="mesh-secret")``) only on links to members; a member takes
  a secret that ranks above its own and passes it on. A node that was away learns it from the
  first member it links with: its ``Members`` message shows an older secret, and is answered
  with ours.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from mesh.admission import Admission
from mesh.errors import GossipDecodeError, MeshError
from mesh.gossip import Members, NodeState
from mesh.gossiper import gossip_frame
from mesh.identity import short_id
from mesh.membership.codec import MessageCodec
from mesh.membership.members import MeshCredentials, save_credentials
from mesh.roster import Roster
from mesh.tunnel.connection import PeerConnection
from mesh.tunnel.frames import Control

log = logging.getLogger(__name__)

RESEND_S = 5.0  # a peer whose member digest differs is sent ours at most this often
SECRET_KIND = "mesh-secret"


class SecretMessage(BaseModel):
    """The mesh secret's next generation, sent over authenticated links to members only."""

    model_config = ConfigDict(extra="ignore")

    mesh_id: str
    generation: int = Field(ge=0)
    secret: str = Field(min_length=16, max_length=256)


_SECRET: MessageCodec[SecretMessage] = MessageCodec(
    SecretMessage, GossipDecodeError, "mesh secret message"
)


@dataclass
class MemberSync:
    """See the module docstring. ``cut_off(node_id)`` ends everything a node has open here;
    ``ignore(peer_id, reason, now)`` counts and logs what was refused."""

    roster: Roster
    admission: Admission  # holds the credentials (the secret) and the home they are saved in
    links: Callable[[], dict[str, PeerConnection]]
    cut_off: Callable[[str], None]
    ignore: Callable[[str, str, float], None]
    spawn: Callable[[Awaitable[None]], None]
    _sent_at: dict[str, float] = field(default_factory=dict)

    def members_frame(self) -> Control:
        return gossip_frame(self.roster.message(self.admission.credentials))

    def digest(self) -> str:
        ledger = self.roster.members.ledger
        return ledger.digest() if ledger is not None else ""

    def broadcast(self) -> None:
        """Our facts to every member's link (after a change)."""
        self._send_to_members(self.members_frame())

    # ---- what peers send

    def on_members(self, peer_id: str, message: Members, now: float) -> None:
        change = self.roster.merge(message, time.time())
        for reason, count in change.refused.items():
            for _ in range(count):
                self.ignore(peer_id, f"member fact refused: {reason}", now)
        for node_id in change.left:
            self.cut_off(node_id)
        if change.joined or change.left:
            self.broadcast()  # it may have reached us alone: pass it on
        credentials = self.admission.credentials
        theirs = (message.secret_generation, message.secret_digest)
        if credentials is not None and theirs < credentials.secret_rank():
            self._send(peer_id, self._secret_frame())

    def on_state(self, peer_id: str, state: NodeState, now: float) -> None:
        """A peer's state names the facts it holds: resend ours when they differ."""
        if not state.members_digest or state.members_digest == self.digest():
            return
        if now - self._sent_at.get(peer_id, -RESEND_S) < RESEND_S:
            return
        self._sent_at[peer_id] = now
        self._send(peer_id, self.members_frame())

    def on_secret(self, peer_id: str, body: dict) -> None:
        """A member's newer mesh secret: take it (saved) and pass it on."""
        message = _SECRET.from_dict(body)
        credentials = self.admission.credentials
        if credentials is None or message.mesh_id != credentials.mesh_id:
            raise GossipDecodeError("mesh secret for another mesh")
        offered = credentials.model_copy(
            update={"mesh_secret": message.secret, "secret_generation": message.generation}
        )
        if offered.secret_rank() <= credentials.secret_rank():
            return
        self._take_secret(offered)
        log.info("mesh secret: generation %d, from %s", message.generation, short_id(peer_id))
        self._send_secret(exclude=peer_id)

    # ---- what this node does

    def after_removal(self) -> None:
        """Rotate the secret and tell the remaining members: the facts, then the secret."""
        credentials = self.admission.credentials
        assert credentials is not None
        self._take_secret(credentials.rotated())
        self.broadcast()
        self._send_secret()

    def _take_secret(self, credentials: MeshCredentials) -> None:
        self.admission.credentials = credentials
        save_credentials(self.admission.home, credentials)

    def _secret_frame(self) -> Control:
        credentials = self.admission.credentials
        assert credentials is not None
        message = SecretMessage(
            mesh_id=credentials.mesh_id,
            generation=credentials.secret_generation,
            secret=credentials.mesh_secret,
        )
        return Control(kind=SECRET_KIND, body=message.model_dump())

    def _send_secret(self, exclude: str = "") -> None:
        self._send_to_members(self._secret_frame(), exclude)

    def _send_to_members(self, frame: Control, exclude: str = "") -> None:
        """Only on links to members: a removed node's link may not have ended yet."""
        members = self.roster.members.members
        for peer_id in list(self.links()):
            if peer_id in members and peer_id != exclude:
                self._send(peer_id, frame)

    def _send(self, peer_id: str, frame: Control) -> None:
        conn = self.links().get(peer_id)
        if conn is not None and conn.control is not None:
            self.spawn(_send(conn, peer_id, frame))


async def _send(conn: PeerConnection, peer_id: str, frame: Control) -> None:
    try:
        async with asyncio.timeout(1.0):
            await conn.control.send(frame)  # type: ignore[union-attr]
    except (MeshError, TimeoutError) as exc:
        log.debug("member sync to %s failed: %s", short_id(peer_id), exc)
