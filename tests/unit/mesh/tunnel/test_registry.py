"""The tunnel's tie-break rules without sockets: which connection to a peer wins."""

from __future__ import annotations

import pytest

from mesh.tunnel.registry import (
    Link,
    Verdict,
    decide,
    needs_probe,
    stale_after,
    waits_for_own_dial,
)

LOW, HIGH = "1" * 64, "f" * 64
STALE = stale_after(1.0)


def test_the_first_connection_to_a_peer_is_registered() -> None:
    assert decide(None, Link(initiator=LOW), stale_after=STALE).verdict is Verdict.REGISTER


@pytest.mark.parametrize("side", [LOW, HIGH])
def test_a_second_dial_from_the_same_side_replaces_the_first(side) -> None:
    # The peer restarted and dialed again while its old connection still looked open.
    decision = decide(Link(side), Link(side), stale_after=STALE)
    assert decision.verdict is Verdict.REPLACE and "same side" in decision.why


def test_a_silent_old_connection_loses_even_to_the_higher_ids_dial() -> None:
    old = Link(initiator=LOW, silent_for=STALE + 0.1)
    decision = decide(old, Link(initiator=HIGH), stale_after=STALE)
    assert decision.verdict is Verdict.REPLACE and "silent" in decision.why


def test_simultaneous_dials_keep_the_lower_ids_dial_on_both_sides() -> None:
    # Seen from either node, whichever order the two connections became ready in.
    assert decide(Link(HIGH), Link(LOW), stale_after=STALE).verdict is Verdict.REPLACE
    assert decide(Link(LOW), Link(HIGH), stale_after=STALE).verdict is Verdict.REFUSE


def test_a_live_connection_is_not_stale_at_the_bound() -> None:
    old = Link(initiator=LOW, silent_for=STALE)
    assert decide(old, Link(initiator=HIGH), stale_after=STALE).verdict is Verdict.REFUSE


def test_stale_after_follows_the_ping_interval_with_a_floor() -> None:
    assert stale_after(1.0) == 2.0
    assert stale_after(0.01) == 0.25


def test_only_an_incoming_dial_from_a_higher_id_waits_for_our_own_dial() -> None:
    assert waits_for_own_dial(LOW, HIGH, incoming=True)
    assert not waits_for_own_dial(HIGH, LOW, incoming=True)  # its dial wins anyway
    assert not waits_for_own_dial(LOW, HIGH, incoming=False)  # we dialed it ourselves
    assert not waits_for_own_dial(LOW, None, incoming=True)  # peer not identified yet


def test_a_second_live_node_with_the_same_id_from_another_address_is_a_duplicate() -> None:
    old = Link(initiator=HIGH, address="10.0.0.1:9338", answered_probe=True)
    new = Link(initiator=HIGH, address="10.0.0.2:9338")
    decision = decide(old, new, stale_after=STALE)
    assert decision.verdict is Verdict.DUPLICATE
    assert "10.0.0.1:9338" in decision.why and "10.0.0.2:9338" in decision.why


def test_a_restart_is_told_from_a_duplicate_by_the_probe() -> None:
    old = Link(initiator=HIGH, address="10.0.0.1:9338")
    new = Link(initiator=HIGH, address="10.0.0.1:40001")  # a restart picks a new UDP port
    assert needs_probe(old, new, stale_after=STALE)
    assert decide(old, new, stale_after=STALE).verdict is Verdict.REPLACE  # it did not answer
    same_place = Link(initiator=HIGH, address="10.0.0.1:9338")
    assert not needs_probe(old, same_place, stale_after=STALE)
    silent = Link(initiator=HIGH, address="10.0.0.1:9338", silent_for=STALE + 1)
    assert not needs_probe(silent, new, stale_after=STALE)  # plainly dead: no need to ask
    other_side = Link(initiator=LOW, address="10.0.0.3:9338")
    assert not needs_probe(old, other_side, stale_after=STALE)
