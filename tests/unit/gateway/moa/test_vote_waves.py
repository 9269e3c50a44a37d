"""The vote's samples start in waves: the arbiter launches the next wave only when a whole wave
is in and the vote is still open; pure over scripted streams, then through the orchestrator."""

from __future__ import annotations

import dataclasses

from gateway.moa import MixtureOfAgents
from gateway.moa.arbiter import Arbiter
from gateway.moa.costs import parse_votes
from gateway.moa.events import Cancel, Commit, Launch, TokenArrived, WorkerFailed, WorkerStarted
from gateway.moa.views import WorkerStatus
from gateway.testing import Stall
from gateway.upstream import ModelInfo, StaticDirectory
from tests.unit.gateway.moa.test_splice import ask, assert_well_formed, collect, mesh_of, meta_of
from tests.unit.gateway.moa.test_vote import CONFIG, answer, names
from tests.unit.gateway.moa.test_vote_run import FAST, says, scripted


def waves(n: int, wave: int, **overrides) -> Arbiter:
    """An arbiter over ``n`` samples in waves of ``wave``, its first wave started."""
    arbiter = Arbiter(
        names(n), dataclasses.replace(CONFIG, **overrides), now=0.0, policy="vote", wave=wave
    )
    for w in arbiter.started():
        assert arbiter.handle(WorkerStarted(w), 0.0) == []
    return arbiter


def test_only_the_first_wave_starts():
    arbiter = waves(8, 4)
    assert arbiter.started() == names(4)
    assert arbiter.workers["w4"].status is WorkerStatus.WAITING
    assert arbiter.next_deadline() is not None  # the running wave's deadlines only


def test_a_unanimous_first_wave_never_starts_the_second():
    arbiter = waves(8, 4)
    for i in range(3):
        assert answer(arbiter, f"w{i}", "12", 1.0 + i) == []
    decisions = answer(arbiter, "w3", "12", 4.0)
    assert decisions == [Commit("w0", "confident")]  # no Launch, nothing running to cancel
    assert arbiter.never_started == 4 and arbiter.stopped_early == 0
    assert arbiter.started() == names(4)


def test_an_undecided_wave_launches_the_next_once_it_is_all_in():
    arbiter = waves(8, 4)
    assert answer(arbiter, "w0", "5", 1.0) == []
    assert answer(arbiter, "w1", "5", 1.1) == []
    assert answer(arbiter, "w2", "6", 1.2) == []  # undecided, but w3 still runs: no launch yet
    decisions = answer(arbiter, "w3", "8", 1.3)
    # 2 : 1 : 1 with 4 to come: two more votes for 5 could decide it, a third could not matter.
    assert decisions == [Launch(("w4", "w5"))]
    assert all(arbiter.workers[w].started_at == 1.3 for w in ("w4", "w5"))  # deadlines from now
    assert arbiter.workers["w6"].status is WorkerStatus.WAITING
    assert [arbiter.handle(WorkerStarted(w), 1.3) for w in ("w4", "w5")] == [[], []]
    assert answer(arbiter, "w4", "5", 2.0) == []
    assert answer(arbiter, "w5", "5", 2.1) == [Commit("w0", "safe")]  # 4 : 1 : 1, 2 to come
    assert arbiter.never_started == 2 and arbiter.started() == names(6)


def test_a_later_wave_is_no_larger_than_the_votes_that_could_decide():
    arbiter = waves(8, 4)
    for i in range(3):
        answer(arbiter, f"w{i}", "5", 1.0)
    # 3 : 0 is not yet confident (0.94), 4 : 0 would be: one more sample, not four.
    assert answer(arbiter, "w3", "I do not know what to say here at all, sorry", 1.0) == [
        Launch(("w4",))
    ]


def test_a_stop_mid_wave_cancels_the_rest_of_it():
    arbiter = waves(8, 4, vote_confidence=0.9)
    assert answer(arbiter, "w0", "5", 1.0) == []
    assert answer(arbiter, "w1", "5", 1.1) == []
    decisions = answer(arbiter, "w2", "5", 1.2)  # 3 : 0 is 0.94 ≥ 0.9 with w3 still running
    assert decisions == [Commit("w0", "confident"), Cancel("w3")]
    assert arbiter.stopped_early == 1 and arbiter.never_started == 4


def test_the_last_wave_is_what_is_left_and_failures_count_as_in():
    arbiter = waves(6, 4, vote_scatter=None)  # three answers of three would be scattered
    arbiter.handle(WorkerFailed("w0", "boom"), 0.5)
    answer(arbiter, "w1", "1", 1.0)
    answer(arbiter, "w2", "2", 1.0)
    assert answer(arbiter, "w3", "3", 1.0) == [Launch(("w4", "w5"))]
    assert arbiter.tally.withdrawn == ["w0"]


def test_a_wave_that_all_fails_launches_the_next_instead_of_failing():
    arbiter = waves(4, 2)
    assert arbiter.handle(WorkerFailed("w0", "boom"), 1.0) == []
    assert arbiter.handle(WorkerFailed("w1", "boom"), 1.0) == [Launch(("w2", "w3"))]
    # One of the new wave fails too: the other is the survivor and streams live.
    arbiter.handle(WorkerStarted("w2"), 1.0)
    arbiter.handle(WorkerStarted("w3"), 1.0)
    assert arbiter.handle(WorkerFailed("w2", "boom"), 2.0) == []
    assert arbiter.handle(TokenArrived("w3", "4"), 2.1) == [Commit("w3", "survivor")]


def test_a_single_sample_wave_is_not_mistaken_for_the_survivor():
    arbiter = waves(3, 1)
    assert arbiter.started() == ["w0"]
    assert answer(arbiter, "w0", "8", 1.0) == [Launch(("w1",))]


# -- through the orchestrator ------------------------------------------------------------------

WAVES = dataclasses.replace(FAST, vote_wave=4)


async def test_the_second_wave_is_never_asked_when_the_first_agrees():
    upstream = scripted(*[says("12", delay=0.01 * i) for i in range(4)], [Stall()])
    moa = MixtureOfAgents(mesh_of(("m", 1, upstream)), WAVES)
    events = await collect(moa, ask(metadata={"moa_policy": "vote"}))
    assert_well_formed(events)
    headers = meta_of(events)
    assert headers["x-moa-workers"] == "4" and headers["x-moa-decision"] == "confident"
    assert headers["x-moa-stopped"] == "0"
    assert upstream.calls == 4 and upstream.cancelled == 0 and upstream.active == 0


async def test_an_open_vote_asks_only_the_samples_that_could_decide_it():
    first = [says("5"), says("5"), says("6"), says("7")]
    upstream = scripted(*first, says("5", delay=0.01), says("5", delay=0.02), [Stall()])
    moa = MixtureOfAgents(mesh_of(("m", 1, upstream)), WAVES)
    events = await collect(moa, ask(metadata={"moa_policy": "vote"}))
    assert_well_formed(events)
    headers = meta_of(events)
    # 2 : 1 : 1 → two more, both say 5: 4 : 1 : 1 with two to come is safe.
    assert headers["x-moa-workers"] == "6" and headers["x-moa-decision"] == "safe"
    assert parse_votes(headers["x-moa-votes"]) == {"5": 4, "6": 1, "7": 1}
    assert upstream.calls == 6 and upstream.cancelled == 0 and upstream.active == 0


async def test_a_stop_mid_wave_stops_the_running_samples():
    upstream = scripted(says("5"), says("5"), says("5"), [Stall()])
    moa = MixtureOfAgents(
        mesh_of(("m", 1, upstream)), dataclasses.replace(WAVES, vote_confidence=0.9)
    )
    events = await collect(moa, ask(metadata={"moa_policy": "vote"}))
    assert meta_of(events)["x-moa-decision"] == "confident"
    assert upstream.calls == 4 and upstream.cancelled == 1 and upstream.active == 0


@dataclasses.dataclass
class IdleOrBusy(StaticDirectory):
    """A directory that says whether every node serving a model is idle (a mesh's does)."""

    idle: bool = True

    def all_idle(self, model: str) -> bool:
        return self.idle


def _directory(upstream, idle: bool) -> IdleOrBusy:
    directory = IdleOrBusy(idle=idle)
    directory.add(ModelInfo("m", parameters=1), upstream)
    return directory


async def test_on_an_idle_mesh_the_vote_starts_every_sample_at_once_and_says_so():
    first = [says("5"), says("5"), says("6"), says("7")]
    upstream = scripted(*first, says("5", delay=0.01), says("5", delay=0.02), [Stall()], [Stall()])
    events = await collect(MixtureOfAgents(_directory(upstream, True), WAVES), ask(metadata={"moa_policy": "vote"}))  # fmt: skip
    assert_well_formed(events)
    headers = meta_of(events)
    assert headers["x-moa-vote-schedule"] == "batch"
    assert upstream.calls == 8  # one batch: no wave waited for another
    assert headers["x-moa-decision"] == "safe" and upstream.active == 0  # the rest stopped


async def test_on_a_busy_mesh_or_without_a_word_on_load_the_vote_goes_in_waves():
    for directory in (lambda u: _directory(u, False), lambda u: mesh_of(("m", 1, u))):
        upstream = scripted(*[says("12", delay=0.01 * i) for i in range(4)], [Stall()])
        events = await collect(MixtureOfAgents(directory(upstream), WAVES), ask(metadata={"moa_policy": "vote"}))  # fmt: skip
        headers = meta_of(events)
        assert headers["x-moa-vote-schedule"] == "waves"
        assert upstream.calls == 4 and headers["x-moa-workers"] == "4"
