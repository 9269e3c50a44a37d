"""Who belongs to the mesh, as each member remembers it: pure data and its files.

``<home>/mesh.json`` (:class:`MeshCredentials`: mesh id + secret) and ``<home>/members.json``
(:class:`MemberStore`: members by node id, with key, certificate pin and addresses, plus the
digests of outstanding invites) – both written atomically with mode 0600. The handshake that
changes them lives in :mod:`mesh.membership.handshake`.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from pydantic import BaseModel, Field

from mesh.files import write_private
from mesh.identity import node_id_of
from mesh.membership.invite import InviteToken, secret_digest


class Member(BaseModel):
    """One node of the mesh as every member remembers it (``members.json``)."""

    node_id: str
    public_key: str  # hex
    fingerprint: str = ""  # certificate fingerprint: the pin for dialing it
    addresses: list[str] = Field(default_factory=list)
    # Unix time the member itself stated these addresses (its own start, or its handshake):
    # second-hand copies from gossip must not undo a newer first-hand one.
    updated_at: float = 0.0


class InviteRecord(BaseModel):
    expires_at: float
    used_by: str | None = None
    used_at: float = 0.0  # when ``used_by`` joined with it (0: before this field existed)


class MeshCredentials(BaseModel):
    """``mesh.json``: which mesh this node belongs to, and the secret every member holds."""

    mesh_id: str
    mesh_secret: str

    @classmethod
    def create(cls) -> MeshCredentials:
        return cls(mesh_id=secrets.token_hex(8), mesh_secret=secrets.token_urlsafe(32))


class MemberStore(BaseModel):
    """Members, removed members and outstanding invites. :func:`save_members` writes it.

    A removed member leaves a tombstone (node id → Unix time of the removal) that travels in
    gossip and is kept for good: no member's copy brings it back, and the handshake refuses
    the node id whatever invite or secret it shows. A machine that should come back joins
    under a new identity (its ``identity/`` deleted) with a fresh invite."""

    members: dict[str, Member] = Field(default_factory=dict)
    invites: dict[str, InviteRecord] = Field(default_factory=dict)  # secret digest → record
    removed: dict[str, float] = Field(default_factory=dict)  # node id → when it was removed

    def add_member(self, member: Member) -> bool:
        """Add or refresh one member; True when something changed. A key never changes."""
        if member.node_id in self.removed:
            return False  # removed: stays out
        known = self.members.get(member.node_id)
        if known is not None and known.public_key != member.public_key:
            return False
        if known == member:
            return False
        if known is not None and (not member.addresses or member.updated_at < known.updated_at):
            if known.addresses:
                return False  # nothing newer than what we know
        self.members[member.node_id] = member
        return True

    def remove(self, node_id: str, now: float) -> bool:
        """Take ``node_id`` out of the mesh (and keep it out); True when it was a member."""
        was_member = self.members.pop(node_id, None) is not None
        self.removed[node_id] = max(now, self.removed.get(node_id, now))
        return was_member

    def merge(self, members: list[Member], removed: dict[str, float] | None = None) -> bool:
        """Fold another member's view in: its tombstones first, then its members."""
        changed = False
        for node_id, when in (removed or {}).items():
            if node_id in self.members or node_id not in self.removed:
                self.remove(node_id, when)
                changed = True
        for member in members:
            try:
                key = bytes.fromhex(member.public_key)
            except ValueError:
                continue  # not a key at all: garbage, like the one below
            if node_id_of(key) != member.node_id:
                continue  # a member entry whose id is not its key's hash is garbage
            changed |= self.add_member(member)
        return changed

    def remember_invite(self, token: InviteToken) -> None:
        self.invites[secret_digest(token.secret)] = InviteRecord(expires_at=token.expires_at)

    def prune_invites(self, now: float) -> None:
        self.invites = {d: r for d, r in self.invites.items() if r.expires_at > now - 86400}


# --------------------------------------------------------------------------- files

MESH_FILE = "mesh.json"
MEMBERS_FILE = "members.json"


def load_credentials(home: Path) -> MeshCredentials | None:
    path = home / MESH_FILE
    if not path.exists():
        return None
    return MeshCredentials.model_validate_json(path.read_bytes())


def save_credentials(home: Path, credentials: MeshCredentials) -> None:
    write_private(home / MESH_FILE, credentials.model_dump_json(indent=2).encode())


def load_members(home: Path) -> MemberStore:
    path = home / MEMBERS_FILE
    if not path.exists():
        return MemberStore()
    return MemberStore.model_validate_json(path.read_bytes())


def save_members(home: Path, store: MemberStore) -> None:
    write_private(home / MEMBERS_FILE, store.model_dump_json(indent=2).encode())
