"""Upgrading a members.json from before signed membership: signed once by the node itself."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import orjson

from mesh.identity import NodeIdentity
from mesh.membership.facts import MIGRATED, Root
from mesh.membership.members import MeshCredentials, load_members
from mesh.roster import Roster

NOW = 1_700_000_000.0


def _entry(m: NodeIdentity) -> dict:
    key = m.public_key_bytes.hex()
    return {
        "node_id": m.node_id,
        "public_key": key,
        "addresses": ["10.0.0.1:9338"],
        "updated_at": NOW,
    }


def _old_file(home: Path, members: list[NodeIdentity], removed: dict[str, float]) -> None:
    """members.json as the previous version wrote it."""
    home.mkdir(parents=True, exist_ok=True)
    entries = {m.node_id: _entry(m) for m in members}
    body = {"members": entries, "invites": {"d" * 64: {"expires_at": NOW}}, "removed": removed}
    (home / "members.json").write_bytes(orjson.dumps(body))


def test_an_old_member_list_is_signed_once_by_the_upgrading_node(tmp_path, caplog) -> None:
    me, b, planted, gone = (NodeIdentity.generate() for _ in range(4))
    home = tmp_path / "a"
    _old_file(home, [me, b, planted], {gone.node_id: NOW - 10})
    credentials = MeshCredentials.create()
    roster = Roster(home, me)
    with caplog.at_level(logging.WARNING):
        roster.settle_credentials(credentials, None)
    assert "predates signed membership" in caplog.text and "2 member(s)" in caplog.text
    store = load_members(home)
    ledger = store.ledger
    assert ledger is not None and ledger.root == Root.of(me)
    assert set(store.members) == {me.node_id, b.node_id, planted.node_id}
    assert {a.invite for a in ledger.admissions} == {MIGRATED}
    assert {a.by for a in ledger.admissions} == {me.node_id}
    assert set(store.removed) == {gone.node_id}  # the old removal, now a signed tombstone
    assert store.members[b.node_id].addresses == ["10.0.0.1:9338"]  # addresses kept
    assert list(store.invites) == ["d" * 64]
    # Shown for the operator to check: a key planted before the upgrade is admitted by us.
    rows = {r["node_id"]: r for r in roster.rows(())}
    assert rows[planted.node_id]["invite"] == MIGRATED[:12]
    # Once: the next start finds a signed file and signs nothing new.
    facts = set(ledger.admissions)
    Roster(home, me).settle_credentials(credentials, None)
    assert set(load_members(home).ledger.admissions) == facts  # type: ignore[union-attr]


def test_two_upgraded_members_agree_and_take_each_others_removals(tmp_path) -> None:
    a, b, c = (NodeIdentity.generate() for _ in range(3))
    credentials = MeshCredentials.create()
    for home, me in ((tmp_path / "a", a), (tmp_path / "b", b)):
        _old_file(home, [a, b, c], {})
        Roster(home, me).settle_credentials(credentials, None)
    on_a, on_b = Roster(tmp_path / "a", a), Roster(tmp_path / "b", b)
    on_b.remove(c.node_id, credentials.mesh_id)  # B, its own root, removes C
    change = on_a.merge(on_b.message(credentials), time.time())
    assert change.left == [c.node_id]  # A takes it: B is a member in A's view
    assert set(on_a.members.members) == {a.node_id, b.node_id}
    assert on_a.removed_rows()[0]["removed_by"] == b.node_id
