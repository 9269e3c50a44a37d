"""Upgrading a ``members.json`` from before signed membership, once, at the node's first start.

Such a file lists members with no admissions, and removed node ids with no keys. Nobody can
sign for the past, so the node's operator vouches for what it held: the node becomes the root
of its own view and signs an admission (``invite: migrated``) for every member it knew, and a
tombstone for every node it had removed (as the root, it may bar a node that is not in). Other
members do the same when they upgrade; each admits the others, so their views agree on who is
in. A key planted in an old file is admitted too: ``mesh members list`` shows who admitted
whom, for the operator to check (docs/mesh.md, *Upgrading an existing mesh*).
"""

from __future__ import annotations

import contextlib

from mesh.membership.facts import (
    MIGRATED,
    Admission,
    Root,
    Signer,
    Tombstone,
    sign_admission,
    sign_tombstone,
)
from mesh.membership.ledger import Change
from mesh.membership.members import MemberFile, MemberStore


def migrate(store: MemberStore, me: Signer, mesh_id: str, now: float) -> Change:
    """Sign ``store.legacy``'s members and removals as this node; ``store`` then has a ledger."""
    legacy = store.legacy or MemberFile()
    admissions: list[Admission] = []
    for member in legacy.members.values():
        if member.node_id == me.node_id:
            continue
        with contextlib.suppress(ValueError):  # a key that is not one was never a member
            admissions.append(
                sign_admission(me, mesh_id, member.node_id, member.public_key, MIGRATED, now)
            )
    tombstones: list[Tombstone] = []
    for node_id, when in legacy.removed.items():
        with contextlib.suppress(ValueError):
            tombstones.append(sign_tombstone(me, mesh_id, node_id, min(when, now)))
    return store.open(mesh_id, Root.of(me), admissions, tombstones, now)
