"""The member list as this node keeps it: loaded from and saved to the home dir, the mesh's
credentials created or checked against a join token (and an old member list signed once, on
upgrade), invites issued, members removed by (a prefix of) their node id – signed, with the
members they alone admitted –, and the member facts peers gossip merged in."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mesh.errors import MembershipError
from mesh.gossip import Members
from mesh.identity import NodeIdentity, short_id
from mesh.membership.facts import Root
from mesh.membership.invite import InviteError, InviteToken, decode_invite, make_invite
from mesh.membership.ledger import Change, message_refusal
from mesh.membership.members import (
    Member,
    MeshCredentials,
    load_members,
    save_credentials,
    save_members,
)
from mesh.membership.migration import migrate

log = logging.getLogger(__name__)


@dataclass
class RemovalReport:
    """What ``mesh members remove`` did (or, with ``dry_run``, would do)."""

    node_id: str
    going_with: list[str] = field(default_factory=list)  # admitted through it: gone with it
    kept: list[str] = field(default_factory=list)  # admitted through it, re-admitted by us
    left: list[str] = field(default_factory=list)  # every node that stopped being a member


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
        if credentials is not None:
            self._open(credentials.mesh_id)
        return credentials, token

    def _open(self, mesh_id: str) -> None:
        """The ledger of a member: as saved; signed now from an old member list (once); or a
        new mesh's, with this node as its root."""
        store = self.members
        if store.ledger is not None:
            if store.ledger.mesh_id != mesh_id:
                raise MembershipError(f"{self.home}/members.json is another mesh's")
            return
        if store.legacy is not None:
            known = len(set(store.legacy.members) - {self.node_id})
            gone = len(store.legacy.removed)
            migrate(store, self.identity, mesh_id, time.time())
            log.warning(
                "members.json predates signed membership: this node signed its %d member(s) "
                "and %d removal(s) as their admitter; check them with `mesh members list`",
                known,
                gone,
            )
        else:
            store.open(mesh_id, Root.of(self.identity))
        self.save()

    def remember_self(self, addresses: list[str]) -> None:
        me = Member(
            node_id=self.node_id,
            public_key=self.identity.public_key_bytes.hex(),
            fingerprint=self.identity.cert_fingerprint,
            addresses=addresses,
            updated_at=time.time(),
        )
        self.members.note_member(me)
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
        """Every member with its addresses, whether it is linked and who admitted it (and
        when), this node first."""
        ledger = self.members.ledger
        rows = []
        for m in self.members.members.values():
            admission = ledger.view.members.get(m.node_id) if ledger else None
            rows.append(
                {
                    "node_id": m.node_id,
                    "addresses": m.addresses,
                    "self": m.node_id == self.node_id,
                    "connected": m.node_id in linked,
                    "root": admission is None,
                    "admitted_by": admission.by if admission else None,
                    "admitted_at": admission.at if admission else None,
                    "invite": admission.invite[:12] if admission else None,
                }
            )
        return sorted(rows, key=lambda row: (not row["self"], row["node_id"]))

    def removed_rows(self) -> list[dict[str, Any]]:
        """Every removed node: who removed it and when (and who had admitted it), oldest first."""
        ledger = self.members.ledger
        if ledger is None:
            return []
        rows = [
            {
                "node_id": node_id,
                "removed_by": removal.tombstone.by,
                "removed_at": removal.tombstone.at,
                "admitted_by": removal.admission.by if removal.admission else None,
            }
            for node_id, removal in ledger.view.removed.items()
        ]
        return sorted(rows, key=lambda row: row["removed_at"])

    def remove(
        self,
        node: str,
        mesh_id: str,
        keep: Sequence[str] = (),
        dry_run: bool = False,
    ) -> RemovalReport:
        """Remove a member by node id (or a unique prefix of one): a tombstone signed by this
        node, persisted. The members it alone admitted go with it, except those in ``keep``
        (prefixes too), which this node admits first. Raises ``MembershipError`` in words."""
        node_id = self._one_member(node, mesh_id)
        if node_id == self.node_id:
            raise MembershipError("a node cannot remove itself; remove it from another member")
        ledger = self.members.ledger
        assert ledger is not None  # a member has a ledger
        if node_id == ledger.root.node_id:
            raise MembershipError(
                f"{short_id(node_id)} is the mesh's root of trust (it created the mesh) and "
                "cannot be removed; to leave it behind, make a new mesh"
            )
        going = ledger.going_with(node_id)
        kept = sorted({self._one_member(k, mesh_id) for k in keep})
        if stray := [k for k in kept if k not in going]:
            raise MembershipError(
                f"--keep {short_id(stray[0])}: it does not go with {short_id(node_id)}"
            )
        report = RemovalReport(node_id, [n for n in going if n not in kept], kept)
        if dry_run:
            return report
        change = self.members.remove(self.identity, node_id, time.time(), kept)
        report.left = change.left
        self.save()
        log.warning(
            "removed member %s from mesh %s%s",
            short_id(node_id),
            mesh_id,
            f" and with it {', '.join(map(short_id, report.going_with))}"
            if report.going_with
            else "",
        )
        return report

    def _one_member(self, node: str, mesh_id: str) -> str:
        wanted = node.strip().lower()
        matches = [n for n in self.members.members if wanted and n.startswith(wanted)]
        if not matches:
            raise MembershipError(f"no member {node!r} in mesh {mesh_id}")
        if len(matches) > 1:
            raise MembershipError(f"{node!r} names {len(matches)} members; give more of the id")
        return matches[0]

    def message(self, credentials: MeshCredentials | None) -> Members:
        """The member list as gossip carries it: all our facts, the members' addresses."""
        ledger = self.members.ledger
        generation, digest = credentials.secret_rank() if credentials else (0, "")
        return Members(
            members=list(self.members.members.values()),
            removed=self.members.removed,
            admissions=sorted(ledger.admissions, key=lambda a: a.at) if ledger else [],
            tombstones=sorted(ledger.tombstones, key=lambda t: t.at) if ledger else [],
            secret_generation=generation,
            secret_digest=digest,
        )

    def merge(self, message: Members, now: float) -> Change:
        """Take in a peer's member facts and addresses; what changed (``left``: the nodes to
        cut off) and what was refused. A message larger than any full ledger is refused whole."""
        too_many = message_refusal(
            len(message.members), len(message.admissions), len(message.tombstones)
        )
        if too_many is not None:
            return Change(refused=Counter({too_many: 1}))
        change = self.members.merge(message.admissions, message.tombstones, now)
        if self.node_id in change.left:
            log.error("this node was removed from its mesh by a member")
        noted = [self.members.note_member(m) for m in message.members if m.node_id != self.node_id]
        if change.joined or change.left or any(noted):
            self.save()
        return change


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
