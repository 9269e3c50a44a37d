"""Admission: the membership handshake, run on a new connection's control stream.

The thin asyncio adapter around :mod:`mesh.membership.handshake`'s sans-IO handshakes: it carries their
messages as ``Control(kind="auth")`` frames, checks the peer's claims against what mutual TLS
proved (its certificate fingerprint and node id), and records the outcome in the member files.
The service closes a refused connection with AUTH_FAILED; the peer's request streams are held
by the tunnel until the connection is admitted, so a refused peer never gets a request read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mesh.errors import HandshakeInputError
from mesh.identity import NodeIdentity
from mesh.membership.handshake import (
    ClientHandshake,
    HandshakeState,
    ServerHandshake,
    Welcome,
    message_from_dict,
)
from mesh.membership.invite import InviteToken
from mesh.membership.members import MemberStore, MeshCredentials, save_credentials, save_members
from mesh.tunnel.connection import PeerConnection
from mesh.tunnel.frames import Control


@dataclass
class Admission:
    identity: NodeIdentity
    home: Path
    members: MemberStore
    credentials: MeshCredentials | None = None
    addresses: list[str] = field(default_factory=list)
    join: InviteToken | None = None  # while joining: the token to present to its inviter
    refusal: str = ""  # what the last peer that refused us said

    async def admit(self, conn: PeerConnection) -> str:
        """Accepting side. Empty string when the peer proved membership, else why not."""
        if self.credentials is None:
            return "this node is not a member of any mesh yet"
        handshake = ServerHandshake(
            me=self.identity,
            credentials=self.credentials,
            store=self.members,
            now=time.time(),
            peer_fingerprint=conn.peer_cert_fingerprint,
            peer_node_id=conn.peer_node_id,
        )
        # Saved (and fsynced) before the Welcome leaves: a newcomer told it is a member must
        # not be forgotten by a crash a moment later, nor its invite become usable again.
        await _exchange(conn, handshake, [], on_accepted=lambda: self.save())
        if handshake.state is not HandshakeState.ACCEPTED:
            return handshake.failure.value if handshake.failure else "refused"
        return ""

    def save(self) -> None:
        save_members(self.home, self.members)

    async def present(self, conn: PeerConnection) -> str:
        """Dialing side: prove membership (or present the invite to its inviter)."""
        join = self.join if self.join and self.join.inviter == conn.peer_node_id else None
        if join is None and self.credentials is None:
            return "no credentials to present"
        handshake = ClientHandshake(
            me=self.identity,
            mesh_id=join.mesh_id if join else self.credentials.mesh_id,  # type: ignore[union-attr]
            expected_peer=conn.peer_node_id,
            invite=join,
            credentials=None if join else self.credentials,
            fingerprint=self.identity.cert_fingerprint,
            addresses=self.addresses,
        )
        await _exchange(conn, handshake, [handshake.start()])
        welcome = handshake.welcome
        if handshake.state is not HandshakeState.ACCEPTED or welcome is None:
            self.refusal = handshake.denied_reason or str(handshake.failure)
            return f"refused by the peer: {self.refusal}"
        if join is not None:
            self.refusal = self._take_welcome(welcome)
            return f"joining: {self.refusal}" if self.refusal else ""
        # A member's facts and addresses come by gossip, first thing on the link: there a
        # removal among them cuts off whoever it removed.
        return ""

    def _take_welcome(self, welcome: Welcome) -> str:
        """Become a member of the inviter's mesh: its facts, its secret; why not, else ""."""
        if welcome.root is None or not welcome.mesh_secret:
            return "the inviter runs an older mlx-mesh; upgrade it first"
        me = self.identity.node_id
        self.members.open(
            welcome.mesh_id, welcome.root, welcome.admissions, welcome.tombstones, time.time()
        )
        if self.members.key_of(me) != self.identity.public_key_bytes.hex():
            self.members.ledger = None
            return "the inviter's Welcome does not admit this node"
        for member in welcome.members:
            self.members.note_member(member)
        self.credentials = MeshCredentials(
            mesh_id=welcome.mesh_id,
            mesh_secret=welcome.mesh_secret,
            secret_generation=welcome.secret_generation,
        )
        save_credentials(self.home, self.credentials)
        save_members(self.home, self.members)
        return ""


async def _exchange(
    conn: PeerConnection,
    handshake,
    outbox: list,
    on_accepted: Callable[[], None] | None = None,
) -> None:
    """Send ``outbox``, then feed the peer's auth messages to ``handshake`` until it is done;
    ``on_accepted`` runs once the handshake accepts, before its last reply is sent.
    Raises HandshakeInputError for anything but an auth message (the caller refuses the peer)."""
    control = conn.control
    assert control is not None
    while True:
        for message in outbox:
            await control.send(Control(kind="auth", body=message.model_dump()))
        if handshake.done:
            return
        frame = await control.recv()
        if not isinstance(frame, Control) or frame.kind != "auth":
            raise HandshakeInputError(f"expected an auth message, got {type(frame).__name__}")
        outbox = handshake.receive(message_from_dict(frame.body))
        if on_accepted is not None and handshake.state is HandshakeState.ACCEPTED:
            on_accepted()
            on_accepted = None
