"""The member list as this node keeps it: loaded from and saved to the home dir, the mesh's
credentials created or checked against a join token, invites issued, members removed by (a
prefix of) their node id, and what peers gossip about members merged in."""

from __future__ import annotations

import logging
import time
from collections.abc import Container
from pathlib import Path
from typing import Any

from mesh.errors import MembershipError
from mesh.gossip import Members
from mesh.identity import NodeIdentity, short_id
from mesh.membership.invite import InviteError, InviteToken, decode_invite, make_invite
from mesh.membership.members import (
    Member,
    MeshCredentials,
    load_members,
    save_credentials,
    save_members,
)

log = logging.getLogger(__name__)


class Roster:
    """This node's view of its mesh's members (``members``), kept on disk under ``home``."""

    def __init__(self, home: Path, identity: NodeIdentity) -> None:
        self.home = home
        self.identity = identity
        self.node_id = identity.node_id
        self.members = load_members(home)

    def save(self) -> None:
        save_members(self.home, self.members)

    def settle_credentials(
        self, credentials: MeshCredentials | None, token: InviteToken | None
    ) -> tuple[MeshCredentials | None, InviteToken | None]:
        """This home's ``credentials`` (created for a new mesh when there are none and no
        token) and the invite still to use (None when already a member of its mesh; the
        credentials stay None only while joining). ``MembershipError`` for another mesh's."""
        if token is not None and credentials is not None:
            if credentials.mesh_id != token.mesh_id:
                raise MembershipError(
                    f"{self.home} already belongs to mesh {credentials.mesh_id}; "
                    "use a fresh --home to join another mesh"
                )
            token = None  # already a member: rejoin by key, not by token
        if token is None and credentials is None:
            credentials = MeshCredentials.create()
            save_credentials(self.home, credentials)
            log.info("created mesh %s", credentials.mesh_id)
        return credentials, token

    def remember_self(self, addresses: list[str]) -> None:
        me = Member(
            node_id=self.node_id,
            public_key=self.identity.public_key_bytes.hex(),
            fingerprint=self.identity.cert_fingerprint,
            addresses=addresses,
            updated_at=time.time(),
        )
        self.members.add_member(me)
        self.save()

    def create_invite(self, mesh_id: str, addresses: list[str], ttl_s: float) -> InviteToken:
        """A one-use token for a newcomer; remembered (as a digest) until it expires."""
        now = time.time()
        token = make_invite(
            mesh_id=mesh_id,
            inviter=self.node_id,
            fingerprint=self.identity.cert_fingerprint,
            addresses=addresses,
            now=now,
            ttl_s=ttl_s,
        )
        self.members.prune_invites(now)
        self.members.remember_invite(token)
        self.save()
        return token

    def rows(self, linked: Container[str]) -> list[dict[str, Any]]:
        """Every member with its addresses and whether it is linked, this node first."""
        rows = [
            {
                "node_id": m.node_id,
                "addresses": m.addresses,
                "self": m.node_id == self.node_id,
                "connected": m.node_id in linked,
            }
            for m in self.members.members.values()
        ]
        return sorted(rows, key=lambda row: (not row["self"], row["node_id"]))

    def remove(self, node: str, mesh_id: str) -> str:
        """Remove a member by node id (or a unique prefix of one), persisted. Returns the full
        node id; raises ``MembershipError`` in words."""
        wanted = node.strip().lower()
        matches = [n for n in self.members.members if wanted and n.startswith(wanted)]
        if not matches:
            raise MembershipError(f"no member {node!r} in mesh {mesh_id}")
        if len(matches) > 1:
            raise MembershipError(f"{node!r} names {len(matches)} members; give more of the id")
        (node_id,) = matches
        if node_id == self.node_id:
            raise MembershipError("a node cannot remove itself; remove it from another member")
        self.members.remove(node_id, time.time())
        self.save()
        log.warning("removed member %s from mesh %s", short_id(node_id), mesh_id)
        return node_id

    def message(self) -> Members:
        """The member list as gossip carries it."""
        return Members(members=list(self.members.members.values()), removed=self.members.removed)

    def merge(self, message: Members, mesh_id: str) -> list[str]:
        """Take in what a peer gossiped about members; the node ids it removed (to cut off)."""
        if self.node_id in message.removed and self.node_id not in self.members.removed:
            log.error("this node was removed from mesh %s by a member", mesh_id)
        others = [m for m in message.members if m.node_id != self.node_id]
        removed = {k: v for k, v in message.removed.items() if k != self.node_id}
        if not self.members.merge(others, removed):
            return []
        self.save()
        return [node_id for node_id in removed if node_id not in self.members.members]


def decode_join_token(text: str | None) -> InviteToken | None:
    if not text:
        return None
    try:
        token = decode_invite(text)
    except InviteError as exc:
        raise MembershipError(str(exc)) from exc
    if token.is_expired(time.time()):
        raise MembershipError("the invite token has expired; ask for a new one")
    return token
