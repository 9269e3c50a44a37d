"""Each model's track record in ``mesh``'s pools (issue 43, item 4): counted from decided votes
and race openings, summed over the mesh with each source bounded, and used to order a pool by
measured quality and to collapse it to a clearly better model."""

from __future__ import annotations

from gateway.events import Done, TextDelta
from gateway.moa import MixtureOfAgents, MoaConfig
from gateway.moa.candidates import mixable_models
from gateway.moa.track_record import (
    MAX_PER_SOURCE,
    MIN_EVIDENCE,
    PRIOR,
    Counts,
    TrackRecord,
    collapsed,
    quality_of,
)
from gateway.testing import ScriptedUpstream
from gateway.upstream import ModelInfo, StaticDirectory
from tests.unit.gateway.moa.test_splice import ask, collect, meta_of, text_of


def test_a_vote_counts_each_models_agreement_only_in_a_pool_of_several_models():
    record = TrackRecord()
    record.record_vote([("a", "4"), ("a", "4"), ("a", "5")], "4")  # one model: says nothing
    assert record.local == {}
    record.record_vote([("a", "4"), ("b", "5"), ("a", "4")], "4")
    record.record_openings([("a", True), ("b", False)])
    assert record.local == {"a": Counts(2, 2, 1, 1), "b": Counts(0, 1, 0, 1)}


def test_quality_needs_evidence_and_a_pool_collapses_only_to_a_clearly_better_model():
    few = {"a": Counts(agreed=5, ballots=5)}
    assert Counts(agreed=5, ballots=5).quality() is None and quality_of("a", few) == PRIOR
    good, bad = Counts(agreed=19, ballots=MIN_EVIDENCE), Counts(agreed=6, ballots=MIN_EVIDENCE)
    close = Counts(agreed=14, ballots=MIN_EVIDENCE)
    assert collapsed(["a", "b"], {"a": good, "b": bad}) == ["a"]
    assert collapsed(["b", "a"], {"a": good, "b": bad}) == ["a"]
    assert collapsed(["a", "b"], {"a": good, "b": close}) == ["a", "b"]  # not clearly better
    assert collapsed(["a", "b"], {"a": good}) == ["a", "b"]  # b not measured yet
    # Of three, the clearly worse one leaves; the two close ones stay.
    assert collapsed(["a", "b", "c"], {"a": good, "b": bad, "c": close}) == ["a", "c"]
    # The race's openings stand in until the votes are enough.
    racer = Counts(passed=2, openings=MIN_EVIDENCE)
    assert racer.quality() is not None and racer.quality() < 0.2


def test_the_mesh_sum_bounds_each_sources_word():
    record = TrackRecord()
    record.record_vote([("a", "4"), ("b", "4")], "4")
    forged = {"b": {"agreed": 0, "ballots": 10**9}, "c": {"ballots": 3, "agreed": 99}}
    total = record.merged([forged])
    assert total["a"] == Counts(1, 1)
    assert total["b"] == Counts(1, 1 + MAX_PER_SOURCE)  # 10**9 ballots weigh as 1000
    assert total["c"] == Counts(3, 3)  # more agreements than ballots: clamped


def test_a_measured_model_orders_the_pool_before_a_larger_one():
    directory = StaticDirectory()
    for name, size in (("small", 1), ("big", 9)):
        info = ModelInfo(name, parameters=size, capabilities={"chat_template": True})
        directory.add(info, ScriptedUpstream.of(TextDelta("x"), Done(), name=name))
    assert [m.id for m in mixable_models(directory)] == ["big", "small"]
    record = {"small": Counts(agreed=16, ballots=MIN_EVIDENCE)}  # 0.77 > the prior
    assert [m.id for m in mixable_models(directory, record)] == ["small", "big"]


async def test_votes_teach_the_mesh_to_drop_the_model_that_disagrees():
    """Three models, the largest always wrong: after enough decided votes its ballots are on
    record as disagreeing with the others', and the pool no longer asks it."""
    directory = StaticDirectory()
    upstreams = {}
    for name, text, size in (("right-a", "4", 1), ("right-b", "4", 2), ("wrong", "5", 3)):
        upstreams[name] = ScriptedUpstream.of(TextDelta(text), Done(), name=name)
        info = ModelInfo(name, parameters=size, capabilities={"chat_template": True})
        directory.add(info, upstreams[name])
    moa = MixtureOfAgents(directory, MoaConfig(policy="vote", vote_wave=8), record=TrackRecord())
    assert mixable_models(directory, moa.track_record())[0].id == "wrong"  # the largest
    asked = 0
    while moa.track_record().get("wrong", Counts()).quality() is None:
        await collect(moa, ask(metadata={"moa_samples": "8"}))
        asked += 1
        assert asked < 30
    pool = [m.id for m in mixable_models(directory, moa.track_record())]
    assert pool == ["right-b", "right-a"]
    before = upstreams["wrong"].calls
    events = await collect(moa, ask(metadata={"moa_samples": "4"}))
    assert upstreams["wrong"].calls == before and text_of(events) == "4"
    assert meta_of(events)["x-moa-winner"].startswith("right")


def test_a_measured_quality_is_the_race_score_standing_else_the_win_rate():
    moa = MixtureOfAgents(StaticDirectory(), MoaConfig())
    moa.wins.record(["a", "b"], "a")
    record = {"a": Counts(agreed=2, ballots=MIN_EVIDENCE)}  # measured: clearly disagrees
    assert moa.standing("a", record) == 3 / 22
    assert moa.standing("a", {}) == 2 / 3 and moa.standing("b", record) == 1 / 3
