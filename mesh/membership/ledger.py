"""Who is a member, derived from signed facts: the pure core every node runs alike.

A :class:`Ledger` holds a mesh's :class:`~mesh.membership.facts.Root`, the admissions and the
tombstones that count, and the :class:`View` they make. :meth:`Ledger.merge` takes facts from
anywhere (a peer's gossip, a Welcome, the node's own file), and re-derives the view from all it
holds plus them (``docs/mesh.md``, *Membership*):

1. Tombstones in order of ``(at, node_id, by)``: one counts when its signer is a member at
   that point, its target is a member then (or the signer is the root) and is neither the
   root nor the signer.
2. Members: the closure of admissions from the root, skipping removed nodes and admissions
   whose signer is not a member – so removing a node drops whoever it alone admitted.

Then it keeps only what counts: the admissions of members (at most ``ADMISSIONS_PER_MEMBER``
each), the chains that made each removed node and each remover a member when the tombstone
was signed, and the tombstones that count. The same facts give the same view and the same
kept set on every node, whatever order they came in, so members converge by exchanging them.
Nothing here does I/O or reads a clock: ``now`` is passed in.
"""

from __future__ import annotations

import enum
import hashlib
from collections import Counter, defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from mesh.membership.facts import (
    KEPT,
    Admission,
    Fact,
    Root,
    Signer,
    Tombstone,
    sign_admission,
    sign_tombstone,
    signature_holds,
)

MAX_MEMBERS = 128  # a home or a lab: a fresh key past this is a flood, not a colleague
MAX_REMOVED = 512  # tombstones are kept for good; the root's are taken past this too
ADMISSIONS_PER_MEMBER = 3  # a member admitted by several: it stays while any of them does
# What one message (a gossip frame, a Welcome) may carry: all a full ledger holds, no more.
MAX_MESSAGE_MEMBERS = MAX_MEMBERS
MAX_MESSAGE_ADMISSIONS = MAX_MEMBERS * ADMISSIONS_PER_MEMBER + MAX_REMOVED
MAX_MESSAGE_TOMBSTONES = MAX_REMOVED
FUTURE_SKEW_S = 86400.0  # a fact dated further ahead of our clock waits (it comes again)


class Refused(enum.StrEnum):
    """Why a fact was not taken (counted, and logged by the adapter)."""

    FORGED = "forged"  # node id is not its key's hash, or a node admits itself
    BAD_SIGNATURE = "bad_signature"
    SIGNER_NOT_A_MEMBER = "signer_not_a_member"  # never was one, or removed before it signed
    TARGET_NOT_A_MEMBER = "target_not_a_member"  # a tombstone of a node that was not in
    ROOT = "removes_the_root"
    SELF = "removes_itself"
    MEMBERS_CAP = "members_cap"
    REMOVED_CAP = "removed_cap"
    FUTURE = "dated_in_the_future"
    TOO_MANY = "too_many_entries"  # the whole message


@dataclass(frozen=True)
class Removal:
    tombstone: Tombstone
    admission: Admission | None  # what made the node a member when it was removed, if it was


@dataclass
class View:
    """The members (node id → the admission that made it one; None for the root) and the
    removed nodes (node id → its removal)."""

    members: dict[str, Admission | None]
    removed: dict[str, Removal] = field(default_factory=dict)


@dataclass
class Change:
    """What a merge did: who became a member, who stopped being one (removed, or gone with
    the node that admitted it) and the new facts it refused, by reason."""

    joined: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    refused: Counter[str] = field(default_factory=Counter)


def message_refusal(members: int, admissions: int, tombstones: int) -> Refused | None:
    """``TOO_MANY`` when one message carries more than any full ledger would."""
    if (
        members > MAX_MESSAGE_MEMBERS
        or admissions > MAX_MESSAGE_ADMISSIONS
        or tombstones > MAX_MESSAGE_TOMBSTONES
    ):
        return Refused.TOO_MANY
    return None


class Ledger:
    """A mesh's signed member facts and the view they make (see the module docstring)."""

    def __init__(self, mesh_id: str, root: Root) -> None:
        if not root.is_consistent():
            raise ValueError("the root's node id is not its key's hash")
        self.mesh_id = mesh_id
        self.root = root
        self.admissions: set[Admission] = set()
        self.tombstones: set[Tombstone] = set()
        self.view = View(members={root.node_id: None})
        self._verified: set[Fact] = set()  # facts whose signature was checked and holds

    # ---- questions

    def is_member(self, node_id: str) -> bool:
        return node_id in self.view.members

    def key_of(self, node_id: str) -> str | None:
        """A member's public key (hex), or None for a node that is not one."""
        if node_id == self.root.node_id:
            return self.root.public_key
        admission = self.view.members.get(node_id)
        return admission.public_key if admission is not None else None

    def going_with(self, node_id: str) -> list[str]:
        """The members that would stop being members with ``node_id``: those whose every
        admission leads through it."""
        if node_id not in self.view.members or node_id == self.root.node_id:
            return []
        removed = dict.fromkeys([*self.view.removed, node_id])
        after = _Derivation(self).closure(removed)
        return sorted(set(self.view.members) - set(after) - {node_id})

    def digest(self) -> str:
        """Names the facts held: two nodes with the same digest hold the same facts."""
        held: list[Fact] = [*self.admissions, *self.tombstones]
        signatures = sorted(f.signature for f in held)
        return hashlib.sha256("".join(signatures).encode()).hexdigest()[:32]

    # ---- changes

    def merge(
        self, admissions: Iterable[Admission], tombstones: Iterable[Tombstone], now: float
    ) -> Change:
        """Take in facts from anywhere; returns what changed. Never raises for bad input."""
        change = Change()
        fresh: set[Fact] = set()
        offered: list[Fact] = [*admissions, *tombstones]
        for fact in offered:
            if fact in self.admissions or fact in self.tombstones:
                continue
            if fact.at > now + FUTURE_SKEW_S:
                change.refused[Refused.FUTURE] += 1
            elif isinstance(fact, Admission) and not fact.is_consistent():
                change.refused[Refused.FORGED] += 1
            else:
                fresh.add(fact)
        # Signed by a key no fact names: it cannot count, whatever else arrives with it –
        # refused before any derivation (a flood of junk must not cost one each).
        known = {self.root.node_id} | {a.node_id for a in self.admissions}
        known |= {f.node_id for f in fresh if isinstance(f, Admission)}
        for fact in [f for f in fresh if f.by not in known]:
            fresh.discard(fact)
            change.refused[Refused.SIGNER_NOT_A_MEMBER] += 1
        if len(self.view.members) >= MAX_MEMBERS and not any(
            isinstance(f, Tombstone) for f in fresh
        ):  # full, and nothing that frees a seat: a newcomer's admission cannot count
            for fact in [f for f in fresh if f.node_id not in self.view.members]:
                fresh.discard(fact)
                change.refused[Refused.MEMBERS_CAP] += 1
        if not fresh:
            return change
        fresh_offered = set(fresh)
        before = set(self.view.members)
        derivation = _Derivation(self, fresh)
        result = derivation.run()
        self.view, self.admissions, self.tombstones = result
        self._verified &= self.admissions | self.tombstones
        for fact in fresh_offered - self.admissions - self.tombstones:
            reason = derivation.reasons.get(fact)
            if reason is not None:
                change.refused[reason] += 1
        change.joined = sorted(set(self.view.members) - before)
        change.left = sorted(before - set(self.view.members))
        return change

    def admit(
        self, signer: Signer, node_id: str, public_key: str, invite: str, now: float
    ) -> Change:
        """``signer`` (a member: this node) admits a key; the fact is signed and merged."""
        fact = sign_admission(signer, self.mesh_id, node_id, public_key, invite, now)
        return self.merge([fact], [], now)

    def remove(self, signer: Signer, node_id: str, now: float, keep: Iterable[str] = ()) -> Change:
        """``signer`` removes ``node_id``; each of ``keep`` (members that would go with it) is
        admitted by ``signer`` first, so it stays."""
        kept = [
            sign_admission(signer, self.mesh_id, k, key, KEPT, now)
            for k in keep
            if (key := self.key_of(k)) is not None and k != signer.node_id
        ]
        tombstone = sign_tombstone(signer, self.mesh_id, node_id, now)
        return self.merge(kept, [tombstone], now)

    def holds(self, fact: Fact, key: str) -> bool:
        """``fact``'s signature holds for ``key`` (hex); checked once per fact."""
        if fact in self._verified:
            return True
        if not signature_holds(fact, self.mesh_id, key):
            return False
        self._verified.add(fact)
        return True


def _order(fact: Fact) -> tuple:
    return (fact.at, fact.node_id, fact.by, fact.signature)


class _Derivation:
    """One derivation of a ledger's view from its facts plus ``fresh`` ones; ``reasons``: why
    each fact that does not count does not."""

    def __init__(self, ledger: Ledger, fresh: Iterable[Fact] = ()) -> None:
        self.ledger = ledger
        self.root = ledger.root.node_id
        # At the members cap, the members we have come first: a flood of newcomers (however
        # it is dated) is refused rather than pushing anyone out.
        self.prefer = set(ledger.view.members)
        admissions = set(ledger.admissions)
        self.tombstones = set(ledger.tombstones)
        for fact in fresh:
            if isinstance(fact, Admission):
                admissions.add(fact)
            else:
                self.tombstones.add(fact)
        self.by_signer: dict[str, list[Admission]] = defaultdict(list)
        for admission in sorted(admissions, key=_order):
            self.by_signer[admission.by].append(admission)
        self.reasons: dict[Fact, Refused] = {}
        self.capped = False  # the last closure refused someone for the members cap

    def closure(self, removed: Iterable[str]) -> dict[str, Admission | None]:
        """The members reachable from the root through admissions by members, skipping
        ``removed`` nodes; each with the admission that reached it. At the members cap, the
        members we had are taken first (and only then: below it, the result must not depend
        on what this node had, or nodes with the same facts would keep different ones)."""
        gone = set(removed)
        out = self._reach(gone, prefer=None)
        return self._reach(gone, prefer=self.prefer) if self.capped else out

    def _reach(self, gone: set[str], prefer: set[str] | None) -> dict[str, Admission | None]:
        out: dict[str, Admission | None] = {self.root: None}
        keys = {self.root: self.ledger.root.public_key}
        self.capped = False
        for only_preferred in (True, False) if prefer is not None else (False,):
            queue = deque(out)
            while queue:
                signer = queue.popleft()
                for admission in self.by_signer.get(signer, ()):
                    node = admission.node_id
                    if node in out or node in gone:
                        continue
                    if only_preferred and node not in prefer:  # type: ignore[operator]
                        continue
                    if not self._holds(admission, keys[signer]):
                        continue
                    if len(out) >= MAX_MEMBERS:
                        self.reasons[admission] = Refused.MEMBERS_CAP
                        self.capped = True
                        continue
                    out[node] = admission
                    keys[node] = admission.public_key
                    queue.append(node)
        return out

    def run(self) -> tuple[View, set[Admission], set[Tombstone]]:
        removed: dict[str, Removal] = {}
        members = self.closure(())
        kept: set[Admission] = set()
        for tombstone in sorted(self.tombstones, key=_order):
            if tombstone.node_id in removed:
                continue  # removed by an earlier tombstone: redundant, not refused
            reason = self._refusal(tombstone, members, removed)
            if reason is not None:
                self.reasons.setdefault(tombstone, reason)
                continue
            removed[tombstone.node_id] = Removal(tombstone, members.get(tombstone.node_id))
            # The chains that made both members then: what re-derives this removal anywhere.
            kept |= _chain(members, tombstone.node_id) | _chain(members, tombstone.by)
            members = self._without(members, tombstone.node_id, removed)
        for node in members:
            kept |= _chain(members, node)
            kept |= set(self._extra_admissions(node, members))
        for admission in {a for signed in self.by_signer.values() for a in signed} - kept:
            if admission.by not in members:
                self.reasons.setdefault(admission, Refused.SIGNER_NOT_A_MEMBER)
        tombstones = {r.tombstone for r in removed.values()}
        return View(members, removed), kept, tombstones

    def _without(
        self, members: dict[str, Admission | None], node: str, removed: dict[str, Removal]
    ) -> dict[str, Admission | None]:
        """The closure once ``node`` is removed. A node that reached no one is simply dropped
        (the closure would find every other member the same way); else, or at the members
        cap (a seat freed may take someone in), it is derived again."""
        if self.capped or any(a is not None and a.by == node for a in members.values()):
            return self.closure(removed)
        return {n: a for n, a in members.items() if n != node}

    def _refusal(
        self,
        tombstone: Tombstone,
        members: dict[str, Admission | None],
        removed: dict[str, Removal],
    ) -> Refused | None:
        if tombstone.node_id == self.root:
            return Refused.ROOT
        if tombstone.node_id == tombstone.by:
            return Refused.SELF
        if tombstone.by not in members:
            return Refused.SIGNER_NOT_A_MEMBER
        if tombstone.node_id not in members and tombstone.by != self.root:
            # (The root may bar a node that is not in: an upgraded node's removals from before
            # signed membership name node ids whose keys it never had.)
            return Refused.TARGET_NOT_A_MEMBER
        if not self._holds(tombstone, self._key(members, tombstone.by)):
            return Refused.BAD_SIGNATURE
        if len(removed) >= MAX_REMOVED and tombstone.by != self.root:
            return Refused.REMOVED_CAP
        return None

    def _extra_admissions(self, node: str, members: dict[str, Admission | None]) -> list[Admission]:
        """Besides the one that reached it, a member's other admissions by members, so that
        it stays a member if that one's signer goes (at most ADMISSIONS_PER_MEMBER in all)."""
        first = members[node]
        if first is None:
            return []
        out = []
        for signer, signed in self.by_signer.items():
            if signer not in members or signer == first.by:
                continue
            key = self._key(members, signer)
            for admission in signed:
                if admission.node_id == node and self._holds(admission, key):
                    out.append(admission)
                    break
        return sorted(out, key=_order)[: ADMISSIONS_PER_MEMBER - 1]

    def _key(self, members: dict[str, Admission | None], node: str) -> str:
        admission = members[node]
        return admission.public_key if admission is not None else self.ledger.root.public_key

    def _holds(self, fact: Fact, key: str) -> bool:
        if self.ledger.holds(fact, key):
            return True
        self.reasons[fact] = Refused.BAD_SIGNATURE
        return False


def _chain(members: dict[str, Admission | None], node: str) -> set[Admission]:
    """The admissions from the root to ``node`` in ``members``."""
    out: set[Admission] = set()
    admission = members.get(node)
    while admission is not None:
        out.add(admission)
        admission = members.get(admission.by)
    return out
