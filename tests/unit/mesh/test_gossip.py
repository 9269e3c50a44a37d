"""Gossip messages and the publisher's timing decisions, driven by an explicit clock."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mesh.gossip import (
    GossipDecodeError,
    GossipPublisher,
    Leave,
    Members,
    ModelAd,
    NodeState,
    gossip_from_dict,
)
from mesh.membership.members import Member


def _state(**kw) -> NodeState:
    return NodeState(node_id="n", models=[ModelAd(name="m", context_length=2048)], **kw)


@pytest.mark.parametrize(
    "message",
    [
        _state(queue_depth=3, tok_s=12.5, gateway_url="http://127.0.0.1:9337"),
        Leave(node_id="n"),
        Members(members=[Member(node_id="a", public_key="00")]),
    ],
)
def test_roundtrip(message):
    # The wire path: model_dump -> the Control frame's JSON -> gossip_from_dict.
    assert gossip_from_dict(orjson.loads(orjson.dumps(message.model_dump()))) == message


def test_newer_peers_may_add_fields():
    state = gossip_from_dict({"type": "state", "node_id": "n", "seq": 2, "gpu": "m4"})
    assert isinstance(state, NodeState) and state.seq == 2


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


@given(st.dictionaries(st.sampled_from(["type", "node_id", "seq", "members", "x"]), JSON) | JSON)
def test_garbage_raises_only_decode_error(data):
    try:
        gossip_from_dict(data)
    except GossipDecodeError:
        pass


def test_publisher_first_poll_publishes_and_sets_identity():
    pub = GossipPublisher(node_id="me", interval_s=2.0)
    out = pub.poll(_state(), now=0.0)
    assert out is not None and out.node_id == "me" and out.seq == 1 and out.epoch == pub.epoch


def test_publisher_heartbeat_when_unchanged():
    pub = GossipPublisher(node_id="me", interval_s=2.0)
    pub.poll(_state(), now=0.0)
    assert pub.poll(_state(), now=1.0) is None
    assert pub.poll(_state(), now=1.99) is None  # the heartbeat is due at 2.0, not before
    beat = pub.poll(_state(), now=2.0)
    assert beat is not None and beat.seq == 2


def test_publisher_publishes_changes_early_but_rate_limited():
    pub = GossipPublisher(node_id="me", interval_s=2.0, min_gap_s=0.25)
    pub.poll(_state(), now=0.0)
    assert pub.poll(_state(queue_depth=1), now=0.1) is None  # within min gap
    changed = pub.poll(_state(queue_depth=1), now=0.3)
    assert changed is not None and changed.queue_depth == 1
    assert pub.poll(_state(queue_depth=1), now=0.6) is None  # unchanged, not yet due


def test_the_cache_digest_travels_in_the_state_and_its_change_is_published():
    from mesh.gossip import GossipPublisher, NodeState, gossip_from_dict

    state = NodeState(node_id="a", cache={"m": "64:AAAAAAAAAAA="})
    assert gossip_from_dict(state.model_dump()) == state
    assert gossip_from_dict(NodeState(node_id="a").model_dump()).cache == {}  # older peers
    publisher = GossipPublisher("a", min_gap_s=0.25)
    assert publisher.poll(state, now=0.0) is not None
    assert publisher.poll(state, now=0.5) is None  # unchanged: waits for the heartbeat
    changed = state.model_copy(update={"cache": {"m": "64:"}})
    assert publisher.poll(changed, now=0.5) is not None
