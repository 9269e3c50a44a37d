"""The signed-membership core, without I/O: admissions and tombstones that count and those that
do not (forged, replayed, signed by a non-member, past the caps), the cascade on removal, and –
with hypothesis – that any two nodes given the same facts in any order agree, and that no
forged or replayed fact ever makes a key a member."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh.identity import NodeIdentity
from mesh.membership.facts import (
    Admission,
    Root,
    Tombstone,
    sign_admission,
    sign_tombstone,
)
from mesh.membership.ledger import (
    MAX_MEMBERS,
    MAX_MESSAGE_MEMBERS,
    Ledger,
    Refused,
    message_refusal,
)

MESH = "0123456789abcdef"
NOW = 1_700_000_000.0
KEYS = [NodeIdentity.generate() for _ in range(8)]  # made once: hypothesis reuses them
ROOT, A, B, C, D, E, F, G = KEYS


def ledger() -> Ledger:
    return Ledger(MESH, Root.of(ROOT))


def admit(signer: NodeIdentity, who: NodeIdentity, at: float = NOW, mesh: str = MESH) -> Admission:
    return sign_admission(signer, mesh, who.node_id, who.public_key_bytes.hex(), "inv", at)


def tomb(signer: NodeIdentity, who: NodeIdentity, at: float = NOW) -> Tombstone:
    return sign_tombstone(signer, MESH, who.node_id, at)


def members(book: Ledger) -> set[str]:
    return set(book.view.members)


def ids(*keys: NodeIdentity) -> set[str]:
    return {k.node_id for k in keys}


def test_a_chain_of_admissions_from_the_root_makes_members() -> None:
    book = ledger()
    change = book.merge([admit(A, B), admit(ROOT, A)], [], NOW)  # any order
    assert members(book) == ids(ROOT, A, B)
    assert sorted(change.joined) == sorted(ids(A, B)) and not change.refused
    assert book.key_of(B.node_id) == B.public_key_bytes.hex()


def test_forged_and_foreign_admissions_are_refused_and_not_stored() -> None:
    book = ledger()
    book.merge([admit(ROOT, A)], [], NOW)
    good = admit(A, B)
    wrong_key = good.model_copy(update={"public_key": C.public_key_bytes.hex()})
    tampered = good.model_copy(update={"invite": "another"})
    by_stranger = admit(E, F)  # E is no member: nothing it signs counts
    other_mesh = admit(A, C, mesh="fedcba9876543210")
    change = book.merge([wrong_key, tampered, by_stranger, other_mesh], [], NOW)
    assert members(book) == ids(ROOT, A)
    assert change.refused == {
        Refused.FORGED: 1,
        Refused.BAD_SIGNATURE: 2,
        Refused.SIGNER_NOT_A_MEMBER: 1,
    }
    assert book.admissions == {admit(ROOT, A)}  # Ed25519 signs deterministically


def test_tombstones_that_do_not_count() -> None:
    book = ledger()
    book.merge([admit(ROOT, A), admit(ROOT, B)], [], NOW)
    change = book.merge(
        [],
        [
            tomb(A, ROOT),
            tomb(A, A),
            tomb(E, B),
            tomb(A, E),
            tomb(B, A).model_copy(update={"by": ROOT.node_id}),
        ],
        NOW,
    )
    assert members(book) == ids(ROOT, A, B) and not book.tombstones
    assert change.refused == {
        Refused.ROOT: 1,
        Refused.SELF: 1,
        Refused.SIGNER_NOT_A_MEMBER: 1,
        Refused.TARGET_NOT_A_MEMBER: 1,
        Refused.BAD_SIGNATURE: 1,
    }


def test_removing_a_member_takes_whoever_it_alone_admitted() -> None:
    book = ledger()
    book.merge([admit(ROOT, A), admit(A, B), admit(B, C), admit(ROOT, D), admit(D, C)], [], NOW)
    assert book.going_with(A.node_id) == [B.node_id]  # C has another way in, through D
    change = book.remove(ROOT, A.node_id, NOW + 1)
    assert members(book) == ids(ROOT, C, D)
    assert sorted(change.left) == sorted(ids(A, B))
    assert set(book.view.removed) == ids(A)  # B went with A, without a tombstone of its own


def test_keep_readmits_before_the_removal() -> None:
    book = ledger()
    book.merge([admit(ROOT, A), admit(A, B), admit(B, C)], [], NOW)
    change = book.remove(ROOT, A.node_id, NOW + 1, keep=[B.node_id])
    assert members(book) == ids(ROOT, B, C) and change.left == [A.node_id]


def test_replays_after_a_removal_change_nothing() -> None:
    book = ledger()
    history = [admit(ROOT, A), admit(A, B)]
    book.merge(history, [], NOW)
    book.remove(ROOT, A.node_id, NOW + 1)
    held_back = admit(A, C, at=NOW - 5)  # signed while A was a member, gossiped after
    readmitted = admit(ROOT, A, at=NOW + 2)  # tombstones win, even over a newer admission
    change = book.merge([*history, held_back, readmitted], [], NOW + 3)
    assert members(book) == ids(ROOT) and not change.joined
    assert A.node_id in book.view.removed


def test_a_removed_member_cannot_remove_after_its_removal() -> None:
    book = ledger()
    book.merge([admit(ROOT, A), admit(ROOT, B), admit(ROOT, C)], [], NOW)
    book.remove(ROOT, A.node_id, NOW + 10)
    late = book.merge([], [tomb(A, B, at=NOW + 11)], NOW + 12)
    assert late.refused == {Refused.SIGNER_NOT_A_MEMBER: 1} and B.node_id in members(book)
    # Dated before its own removal it counts: as a member it could have removed B then. The
    # tombstone says who did it, and the root's removal of A stands.
    early = book.merge([], [tomb(A, C, at=NOW + 9)], NOW + 12)
    assert not early.refused and C.node_id not in members(book)
    assert book.view.removed[C.node_id].tombstone.by == A.node_id


def test_the_members_cap_holds_against_a_flood() -> None:
    book = ledger()
    book.merge([admit(ROOT, A)], [], NOW)
    flood = [admit(A, NodeIdentity.generate()) for _ in range(MAX_MEMBERS + 20)]
    change = book.merge(flood, [], NOW)
    assert len(book.view.members) == MAX_MEMBERS
    assert change.refused[Refused.MEMBERS_CAP] == 20 + 2  # the root and A hold two seats
    # Full: a flood dated before everyone pushes nobody out.
    members_then = members(book)
    backdated = [admit(A, NodeIdentity.generate(), at=1.0) for _ in range(5)]
    assert book.merge(backdated, [], NOW).refused == {Refused.MEMBERS_CAP: 5}
    assert members(book) == members_then
    assert message_refusal(MAX_MESSAGE_MEMBERS + 1, 0, 0) is Refused.TOO_MANY
    assert message_refusal(MAX_MESSAGE_MEMBERS, 0, 0) is None


def test_a_fact_from_the_future_waits() -> None:
    book = ledger()
    change = book.merge([admit(ROOT, A, at=NOW + 2 * 86400)], [], NOW)
    assert change.refused == {Refused.FUTURE: 1} and members(book) == ids(ROOT)
    assert book.merge([admit(ROOT, A, at=NOW + 2 * 86400)], [], NOW + 2 * 86400).joined


# --------------------------------------------------------------------------- hypothesis

# One scripted history: each step, a member (by index) admits a key or removes a node, at a
# time the signer chooses (hostile members date as they like).
STEP = st.tuples(
    st.sampled_from(["admit", "remove"]),
    st.integers(0, len(KEYS) - 1),  # signer
    st.integers(1, len(KEYS) - 1),  # target (never the root: its own test says why)
    st.floats(0, 100),
)


def history(steps: list[tuple[str, int, int, float]]) -> tuple[list[Admission], list[Tombstone]]:
    """Every fact a run of these steps signs (a step by a non-member still signs: a hostile
    or stale node can always sign; whether it counts is the ledger's business)."""
    admissions, tombstones = [], []
    for op, signer, target, at in steps:
        if op == "admit":
            admissions.append(admit(KEYS[signer], KEYS[target], at=NOW + at))
        else:
            tombstones.append(tomb(KEYS[signer], KEYS[target], at=NOW + at))
    return admissions, tombstones


def deliver(book: Ledger, facts: list, cuts: list[int]) -> None:
    """``facts`` in batches cut at ``cuts``, as gossip would bring them."""
    edges = sorted({0, len(facts), *[c % (len(facts) + 1) for c in cuts]})
    for lo, hi in itertools.pairwise(edges):
        batch = facts[lo:hi]
        book.merge(
            [f for f in batch if isinstance(f, Admission)],
            [f for f in batch if isinstance(f, Tombstone)],
            NOW + 1000,
        )


def exchange(one: Ledger, other: Ledger) -> None:
    """What two linked nodes do until their digests agree."""
    for _ in range(4):
        if one.digest() == other.digest():
            return
        other.merge(list(one.admissions), list(one.tombstones), NOW + 1000)
        one.merge(list(other.admissions), list(other.tombstones), NOW + 1000)


SLOW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SLOW
@given(
    st.lists(STEP, max_size=14),
    st.randoms(use_true_random=False),
    st.lists(st.integers(0, 40), max_size=4),
    st.lists(st.integers(0, 40), max_size=4),
)
def test_any_order_of_the_same_facts_gives_the_same_view(steps, rng, cuts_one, cuts_two):
    admissions, tombstones = history(steps)
    facts: list = [*admissions, *tombstones]
    shuffled = list(facts)
    rng.shuffle(shuffled)
    one, two = ledger(), ledger()
    deliver(one, facts, cuts_one)
    deliver(two, shuffled, cuts_two)
    exchange(one, two)
    assert one.view.members == two.view.members
    assert set(one.view.removed) == set(two.view.removed)
    assert one.digest() == two.digest()
    # And what a node keeps re-derives to the same view on a node that starts from it alone.
    fresh = ledger()
    fresh.merge(list(one.admissions), list(one.tombstones), NOW + 1000)
    assert fresh.view.members == one.view.members and fresh.digest() == one.digest()


@SLOW
@given(st.lists(STEP, max_size=12), st.data())
def test_forged_or_replayed_facts_never_make_a_member(steps, data):
    """Take a ledger at any point of a history; offer it every fact of that history again
    (replays), copies with a field changed (forgeries) and facts by keys that were never
    admitted: no node becomes a member that the honest history alone did not make one."""
    admissions, tombstones = history(steps)
    book = ledger()
    book.merge(admissions, tombstones, NOW + 1000)
    honest = set(book.view.members)
    outsider = NodeIdentity.generate()
    forged = (
        [a.model_copy(update={"public_key": outsider.public_key_bytes.hex()}) for a in admissions]
        + [a.model_copy(update={"node_id": outsider.node_id}) for a in admissions]
        + [
            admit(outsider, KEYS[data.draw(st.integers(1, 7))]),
            admit(KEYS[data.draw(st.integers(1, 7))], outsider).model_copy(
                update={"by": ROOT.node_id}
            ),
        ]
    )
    removed_then = set(book.view.removed)
    book.merge([*admissions, *forged], [*tombstones, tomb(outsider, KEYS[1])], NOW + 1000)
    assert set(book.view.members) <= honest
    assert outsider.node_id not in book.view.members
    assert removed_then <= set(book.view.removed)  # tombstones are kept


def test_the_root_may_bar_a_node_that_is_not_in() -> None:
    """An upgraded node's old removals name node ids without keys: as its own root it signs
    tombstones for them, and an admission of such a node (a stale member's copy) then loses."""
    book = ledger()
    change = book.merge([], [tomb(ROOT, C, at=NOW - 100)], NOW)
    assert not change.refused and C.node_id in book.view.removed
    assert book.view.removed[C.node_id].admission is None
    book.merge([admit(ROOT, A), admit(A, C)], [], NOW)
    assert members(book) == ids(ROOT, A)
    # Anyone else's tombstone of a non-member is refused: no junk to keep.
    assert book.merge([], [tomb(A, D)], NOW).refused == {Refused.TARGET_NOT_A_MEMBER: 1}
