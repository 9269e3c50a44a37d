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


class MeshCredentials(BaseModel):
    """``mesh.json``: which mesh this node belongs to, and the secret every member holds."""

    mesh_id: str
    mesh_secret: str

    @classmethod
    def create(cls) -> MeshCredentials:
        return cls(mesh_id=secrets.token_hex(8), mesh_secret=secrets.token_urlsafe(32))


class MemberStore(BaseModel):
    """Members and outstanding invites. :func:`save_members` writes it."""

    members: dict[str, Member] = Field(default_factory=dict)
    invites: dict[str, InviteRecord] = Field(default_factory=dict)  # secret digest → record

    def add_member(self, member: Member) -> bool:
        """Add or refresh one member; True when something changed. A key never changes."""
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

    def merge(self, members: list[Member]) -> bool:
        changed = False
        for member in members:
            if node_id_of(bytes.fromhex(member.public_key)) != member.node_id:
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
