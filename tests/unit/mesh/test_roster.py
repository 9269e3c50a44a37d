"""The roster: removals in words (who, with whom, what may not be removed), and the gossip
message it builds and takes – a full ledger's fits in one frame, a larger one is refused."""

from __future__ import annotations

import orjson
import pytest

from mesh.errors import MembershipError
from mesh.gossip import Members
from mesh.identity import NodeIdentity
from mesh.membership.facts import sign_admission, sign_tombstone
from mesh.membership.ledger import ADMISSIONS_PER_MEMBER, MAX_MEMBERS, MAX_REMOVED, Refused
from mesh.membership.members import Member, MeshCredentials
from mesh.roster import Roster
from mesh.tunnel.frames import MAX_PAYLOAD

NOW = 1_700_000_000.0


@pytest.fixture
def mesh(tmp_path):
    """A root R with members A (admitted by R) and B, C (admitted by A)."""
    root, a, b, c = (NodeIdentity.generate() for _ in range(4))
    credentials = MeshCredentials.create()
    roster = Roster(tmp_path / "r", root)
    roster.settle_credentials(credentials, None)
    store = roster.members
    store.admit(root, Member(node_id=a.node_id, public_key=a.public_key_bytes.hex()), "i", NOW)
    for who in (b, c):
        fact = sign_admission(
            a, credentials.mesh_id, who.node_id, who.public_key_bytes.hex(), "", NOW
        )
        store.merge([fact], [], NOW)
    return roster, credentials, root, a, b, c


def test_what_cannot_be_removed_is_said_in_words(mesh) -> None:
    roster, credentials, root, a, b, c = mesh
    mesh_id = credentials.mesh_id
    with pytest.raises(MembershipError, match="cannot remove itself"):
        roster.remove(root.node_id, mesh_id)
    with pytest.raises(MembershipError, match="no member"):
        roster.remove("ffff", mesh_id)
    with pytest.raises(MembershipError, match="does not go with"):
        roster.remove(b.node_id, mesh_id, keep=[c.node_id])
    other = Roster(roster.home.parent / "a", a)
    other.members = roster.members  # A's own view of the same facts
    with pytest.raises(MembershipError, match="root of trust"):
        other.remove(root.node_id, mesh_id)


def test_remove_with_dry_run_and_keep(mesh) -> None:
    roster, credentials, root, a, b, c = mesh
    dry = roster.remove(a.node_id[:8], credentials.mesh_id, dry_run=True)
    assert sorted(dry.going_with) == sorted([b.node_id, c.node_id]) and not dry.left
    assert a.node_id in roster.members.members  # nothing happened
    report = roster.remove(a.node_id, credentials.mesh_id, keep=[c.node_id[:10]])
    assert report.going_with == [b.node_id] and report.kept == [c.node_id]
    assert sorted(report.left) == sorted([a.node_id, b.node_id])
    assert set(roster.members.members) == {root.node_id, c.node_id}
    (row,) = roster.removed_rows()
    assert row["node_id"] == a.node_id and row["removed_by"] == root.node_id


def test_a_message_larger_than_any_full_ledger_is_refused_whole(mesh) -> None:
    roster, *_ = mesh
    flood = [Member(node_id=f"{i:064x}", public_key="00") for i in range(MAX_MEMBERS + 1)]
    change = roster.merge(Members(members=flood), NOW)
    assert change.refused == {Refused.TOO_MANY: 1} and len(roster.members.members) == 4


def test_a_full_ledgers_message_fits_one_frame(tmp_path) -> None:
    """The most facts a ledger keeps – every member admitted by three members, every removed
    node with its admission and tombstone – still fit one control frame."""
    root = NodeIdentity.generate()
    credentials = MeshCredentials.create()
    roster = Roster(tmp_path, root)
    roster.settle_credentials(credentials, None)
    mesh_id = credentials.mesh_id
    members = [NodeIdentity.generate() for _ in range(MAX_MEMBERS - 1)]
    admitters = [root, *members[: ADMISSIONS_PER_MEMBER - 1]]
    facts = [
        sign_admission(by, mesh_id, m.node_id, m.public_key_bytes.hex(), "f" * 64, NOW + i)
        for i, by in enumerate(admitters)
        for m in members
        if m is not by
    ]
    gone = [NodeIdentity.generate() for _ in range(MAX_REMOVED)]
    tombstones = [sign_tombstone(root, mesh_id, g.node_id, NOW + 10) for g in gone]
    roster.members.merge(facts, tombstones, NOW + 100)
    for m in members:
        roster.members.note_member(
            Member(node_id=m.node_id, public_key=m.public_key_bytes.hex(),
                   fingerprint="f" * 64, addresses=["[fe80::1]:9338", "192.168.100.100:9338"])
        )  # fmt: skip
    message = roster.message(credentials)
    assert len(message.members) == MAX_MEMBERS and len(message.tombstones) == MAX_REMOVED
    assert len(orjson.dumps(message.model_dump())) < MAX_PAYLOAD
