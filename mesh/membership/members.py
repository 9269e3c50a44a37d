"""Who belongs to the mesh, as each member keeps it: the member store and its files.

``<home>/mesh.json`` (:class:`MeshCredentials`: mesh id, the mesh secret and its generation)
and ``<home>/members.json`` (:class:`MemberFile`: the mesh's root of trust, the signed
admissions and tombstones, each member's addresses, the digests of outstanding invites) –
both written atomically, fsynced, mode 0600. :class:`MemberStore` is what the node works
with: the :class:`~mesh.membership.ledger.Ledger` that says who is a member, plus the
addresses and invites beside it. The handshake that changes it lives in
:mod:`mesh.membership.handshake`.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, Field

from mesh.files import write_private
from mesh.membership.facts import Admission, Root, Signer, Tombstone
from mesh.membership.invite import InviteToken, secret_digest
from mesh.membership.ledger import Change, Ledger


class Member(BaseModel):
    """Where a member is (``members.json``): hints for dialing it, not proof of anything."""

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
    """``mesh.json``: which mesh this node belongs to, and the mesh secret (rotated on each
    removal: ``secret_generation`` counts the rotations)."""

    mesh_id: str
    mesh_secret: str
    secret_generation: int = 0

    @classmethod
    def create(cls) -> MeshCredentials:
        return cls(mesh_id=secrets.token_hex(8), mesh_secret=secrets.token_urlsafe(32))

    def rotated(self) -> MeshCredentials:
        """The next generation: a new random secret."""
        return self.model_copy(
            update={
                "mesh_secret": secrets.token_urlsafe(32),
                "secret_generation": self.secret_generation + 1,
            }
        )

    def secret_rank(self) -> tuple[int, str]:
        """Orders secrets: the higher generation wins, and of two made at once by different
        removals, the one with the higher digest – so every member settles on the same one."""
        return self.secret_generation, hashlib.sha256(self.mesh_secret.encode()).hexdigest()


class MemberFile(BaseModel):
    """``members.json`` as written. A file from before signed membership has ``members`` (then
    the member list itself) and unsigned ``removed`` times, and no ``root``."""

    mesh_id: str = ""
    root: Root | None = None
    admissions: list[Admission] = Field(default_factory=list)
    tombstones: list[Tombstone] = Field(default_factory=list)
    members: dict[str, Member] = Field(default_factory=dict)  # node id → its addresses
    invites: dict[str, InviteRecord] = Field(default_factory=dict)  # secret digest → record
    removed: dict[str, float] = Field(default_factory=dict)  # only in files to migrate


class MemberStore:
    """The members (from the ledger), their addresses and the outstanding invites.

    ``ledger`` is None until the node belongs to a mesh (joining), or while an old file waits
    to be migrated (``legacy``: :mod:`mesh.membership.migration`). A removed node leaves a
    tombstone that is kept for good: no member's copy brings it back, and the handshake refuses
    the node id whatever invite or secret it shows."""

    def __init__(self, file: MemberFile | None = None) -> None:
        file = file or MemberFile()
        self.ledger: Ledger | None = None
        self.entries: dict[str, Member] = dict(file.members)
        self.invites: dict[str, InviteRecord] = dict(file.invites)
        self.legacy: MemberFile | None = None
        if file.root is not None:
            self.open(file.mesh_id, file.root, file.admissions, file.tombstones, now=math.inf)
        elif file.members or file.removed:
            self.legacy = file

    def open(
        self,
        mesh_id: str,
        root: Root,
        admissions: Sequence[Admission] = (),
        tombstones: Sequence[Tombstone] = (),
        now: float = math.inf,
    ) -> Change:
        """Start the ledger of ``mesh_id`` under ``root`` with these facts."""
        self.ledger = Ledger(mesh_id, root)
        self.legacy = None
        change = self.ledger.merge(admissions, tombstones, now)
        self._forget_non_members()
        return change

    # ---- who is a member

    @property
    def members(self) -> dict[str, Member]:
        """Every member by node id, with the addresses known for it."""
        if self.ledger is None:
            return {}
        out = {}
        for node_id in self.ledger.view.members:
            entry = self.entries.get(node_id)
            key = self.ledger.key_of(node_id)
            assert key is not None
            out[node_id] = entry or Member(node_id=node_id, public_key=key)
        return out

    @property
    def removed(self) -> dict[str, float]:
        """Removed node id → when it was removed."""
        if self.ledger is None:
            return {}
        return {n: r.tombstone.at for n, r in self.ledger.view.removed.items()}

    def key_of(self, node_id: str) -> str | None:
        return self.ledger.key_of(node_id) if self.ledger is not None else None

    # ---- changes

    def note_member(self, member: Member) -> bool:
        """Take a member's addresses (only a member's: anything else is no one's business);
        True when something changed. Second-hand copies never undo newer first-hand ones."""
        if member.public_key != self.key_of(member.node_id):
            return False  # not a member, or not its key
        known = self.entries.get(member.node_id)
        if known == member:
            return False
        if known is not None and (not member.addresses or member.updated_at < known.updated_at):
            if known.addresses:
                return False  # nothing newer than what we know
        self.entries[member.node_id] = member
        return True

    def merge(self, admissions: list[Admission], tombstones: list[Tombstone], now: float) -> Change:
        """Facts from a peer or a Welcome; nodes that are no longer members lose their entry."""
        if self.ledger is None:
            return Change()
        change = self.ledger.merge(admissions, tombstones, now)
        if change.left:
            self._forget_non_members()
        return change

    def admit(self, me: Signer, member: Member, invite: str, now: float) -> Change:
        """This node admits ``member`` (signed), and keeps its addresses."""
        assert self.ledger is not None, "only a member admits"
        change = self.ledger.admit(me, member.node_id, member.public_key, invite, now)
        self.note_member(member)
        return change

    def remove(self, me: Signer, node_id: str, now: float, keep: Sequence[str]) -> Change:
        assert self.ledger is not None, "only a member removes"
        change = self.ledger.remove(me, node_id, now, keep)
        self._forget_non_members()
        return change

    def _forget_non_members(self) -> None:
        members = self.ledger.view.members if self.ledger is not None else {}
        self.entries = {n: m for n, m in self.entries.items() if n in members}

    def remember_invite(self, token: InviteToken) -> None:
        self.invites[secret_digest(token.secret)] = InviteRecord(expires_at=token.expires_at)

    def prune_invites(self, now: float) -> None:
        self.invites = {d: r for d, r in self.invites.items() if r.expires_at > now - 86400}

    def to_file(self) -> MemberFile:
        if self.legacy is not None:  # not migrated yet: written back as it was
            return self.legacy.model_copy(update={"invites": self.invites})
        ledger = self.ledger
        return MemberFile(
            mesh_id=ledger.mesh_id if ledger else "",
            root=ledger.root if ledger else None,
            admissions=sorted(ledger.admissions, key=_by_time) if ledger else [],
            tombstones=sorted(ledger.tombstones, key=_by_time) if ledger else [],
            members=self.entries,
            invites=self.invites,
        )


def _by_time(fact: Admission | Tombstone) -> tuple[float, str]:
    return fact.at, fact.signature


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
    return MemberStore(MemberFile.model_validate_json(path.read_bytes()))


def save_members(home: Path, store: MemberStore) -> None:
    file = store.to_file()
    write_private(
        home / MEMBERS_FILE, file.model_dump_json(indent=2, exclude_defaults=True).encode()
    )
