"""``model="mesh"``'s track record in gossip (issue 43, item 4): a node's counts per model in
its state, read back by the directory for the pool; older peers send none; a forged count can
neither break the state nor outweigh the bound."""

from __future__ import annotations

import orjson
import pytest
from pydantic import ValidationError

from gateway.moa.track_record import MAX_MODELS, MAX_PER_SOURCE, Counts, TrackRecord
from gateway.upstream import StaticDirectory
from mesh.directory import MeshDirectory
from mesh.gossip import NodeState, gossip_from_dict
from mesh.peers import PeerTable
from mesh.track_records import TrackRecordAd, track_record_ads


def test_the_counts_travel_in_the_state_and_older_states_have_none() -> None:
    record = TrackRecord()
    record.record_vote([("a", "4"), ("b", "5")], "4")
    state = NodeState(node_id="p", track_record=track_record_ads(record.as_dict()))
    assert gossip_from_dict(orjson.loads(orjson.dumps(state.model_dump()))) == state
    assert gossip_from_dict({"type": "state", "node_id": "p"}).track_record == {}
    many = {f"m{i}": {"ballots": 1} for i in range(MAX_MODELS + 5)}
    assert len(track_record_ads(many)) == MAX_MODELS


def test_a_negative_count_is_no_state() -> None:
    with pytest.raises(ValidationError):
        TrackRecordAd(ballots=-1)


def test_the_directory_hands_the_peers_counts_to_the_pool() -> None:
    peers = PeerTable("me")
    ads = {"a": TrackRecordAd(agreed=3, ballots=4), "b": TrackRecordAd(ballots=10**9)}
    peers.on_state(NodeState(node_id="p", track_record=ads), now=0.0)
    peers.on_state(NodeState(node_id="q"), now=0.0)  # an older peer
    directory = MeshDirectory(StaticDirectory(), peers, lambda _: None, clock=lambda: 0.0)  # type: ignore[arg-type,return-value]
    records = directory.track_records()
    assert sorted(map(len, records)) == [0, 2]
    mine = TrackRecord()
    total = mine.merged(records)
    assert total["a"] == Counts(3, 4) and total["b"].ballots == MAX_PER_SOURCE
