"""Which connection to a peer wins: the tie-break rules of the tunnel registry. Pure.

Two nodes may dial each other at once, a restarted peer dials again while its old connection
still looks open, and a node may hold the peer's dial while its own is under way. The endpoint
asks these functions and carries out the answer; they see only node ids, who dialed and how long
a connection has been silent, so every rule is tested without sockets.

Rules, in order, when a second connection to the same peer is ready:

1. the same side dialed again: the peer restarted, and the new one replaces the old – unless
   the new one comes from another address while the old one still answers (it was probed):
   then two live nodes share one node id (a copied home dir) and the newer is refused with
   DUPLICATE_NODE;
2. the old one has been silent for longer than ``stale_after``: the peer restarted, replace;
3. a simultaneous dial: the dial made by the LOWER node id wins;
4. otherwise the existing connection stays and the new one is refused (``Superseded``).

And before that: an incoming connection from a peer with a higher id than ours waits for our own
unfinished dial to that peer, since that dial would win rule 3 (deciding earlier is wrong either
way, see :func:`waits_for_own_dial`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True, slots=True)
class Link:
    """What the tie-break knows of one connection to a peer."""

    initiator: str  # node id of the side that dialed
    silent_for: float = 0.0  # seconds since the peer was last heard on it
    address: str | None = None  # the peer's host:port as we see it
    answered_probe: bool = False  # it answered a liveness probe sent when the rival arrived


class Verdict(Enum):
    REGISTER = "register"  # no other live connection to that peer
    REPLACE = "replace"  # the new one wins; close the old one (SUPERSEDED)
    REFUSE = "refuse"  # the existing one wins; close the new one (SUPERSEDED)
    DUPLICATE = "duplicate"  # two live nodes with one id: close the new one (DUPLICATE_NODE)


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    why: str = ""


def decide(existing: Link | None, new: Link, *, stale_after: float) -> Decision:
    """Whether ``new`` becomes THE connection to its peer, given the ``existing`` one."""
    if existing is None:
        return Decision(Verdict.REGISTER)
    if existing.initiator == new.initiator:
        if existing.answered_probe and existing.address != new.address:
            where = f"{existing.address} and {new.address}"
            return Decision(Verdict.DUPLICATE, f"two live nodes with one node id at {where}")
        return Decision(Verdict.REPLACE, "the same side dialed again")
    if existing.silent_for > stale_after:
        return Decision(Verdict.REPLACE, "the old connection went silent")
    if new.initiator < existing.initiator:
        return Decision(Verdict.REPLACE, "simultaneous dial, lower node id's dial wins")
    return Decision(Verdict.REFUSE, "simultaneous dial, the other dial wins")


def stale_after(ping_interval: float) -> float:
    """Silence after which an existing connection loses to a fresh one from the same peer.
    Both sides ping every ``ping_interval``, so a live peer is rarely silent this long."""
    return max(0.25, 2 * ping_interval)


def needs_probe(existing: Link, new: Link, *, stale_after: float) -> bool:
    """Whether ``new`` must wait for a liveness probe of ``existing`` before :func:`decide`:
    the same side dialed again from another address while the old one does not look dead.
    Its answer tells a restart (the old one is gone) from a copied home dir (it answers)."""
    return (
        existing.initiator == new.initiator
        and existing.address != new.address
        and existing.silent_for <= stale_after
    )


def waits_for_own_dial(self_id: str, peer_id: str | None, *, incoming: bool) -> bool:
    """Whether a connection the peer dialed must wait for our unfinished dial to that peer.

    Only when our dial would win the tie (our id is the lower one). The incoming connection is
    then refused if our dial succeeds (the peer's ``connect`` returns our dial) and registered
    if it fails. Accepting at once would let the peer's ``connect`` return a connection that our
    dial replaces a moment later; refusing at once would lock out a restarted peer while we dial
    its old, dead address.
    """
    return incoming and peer_id is not None and self_id < peer_id
