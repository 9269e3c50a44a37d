"""``judge``: its pure pieces (confidence, options, the judge's request and choice), the arbiter
over scripted candidate events, and the orchestrator with scripted workers and judge."""

from __future__ import annotations

from gateway.events import Done, TextDelta
from gateway.moa import MixtureOfAgents, MoaConfig
from gateway.moa.arbiter import Arbiter
from gateway.moa.events import (
    Cancel,
    Commit,
    StartJudge,
    TokenArrived,
    WorkerFailed,
    WorkerFinished,
)
from gateway.moa.judge import JUDGE, choice_schema, judge_request, options, read_choice
from gateway.moa.views import WorkerStatus, WorkerView
from gateway.request import ChatRequest, Message
from gateway.testing import ScriptedUpstream, Stall, Step
from gateway.upstream import ModelInfo
from tests.unit.gateway.moa.test_splice import (
    ask,
    assert_well_formed,
    collect,
    mesh_of,
    meta_of,
    text_of,
)

CONFIG = MoaConfig(
    policy="judge", grace_s=2.0, first_token_timeout_s=5.0, total_timeout_s=20.0, judge_pick=True
)


def view(name: str, text: str, logprob: float, finish: str = "stop") -> WorkerView:
    out = WorkerView(name, started_at=0.0, status=WorkerStatus.FINISHED, finish_reason=finish)
    out.text, out.tokens, out.logprob_sum, out.logprob_count = text, 4, 4 * logprob, 4
    return out


def feed(arbiter: Arbiter, name: str, text: str, logprob: float, now: float, finish="stop"):
    arbiter.handle(TokenArrived(name, text, logprob=logprob), now)
    return arbiter.handle(WorkerFinished(name, finish), now)


# -- pure pieces --------------------------------------------------------------------------------


def test_options_are_distinct_complete_candidates_most_confident_first():
    views = [
        view("a", "Paris is the capital.", -0.9),
        view("b", "Paris is the capital!", -0.2),  # the same gist as a, more confident
        view("c", "Lyon, surely.", -0.5),
        view("d", "Marseille, cut off", -0.01, finish="length"),  # cut off ranks last
        view("e", "   ", -0.01),  # no text: never an option
    ]
    assert [v.name for v in options(views, 4)] == ["b", "c", "d"]
    assert [v.name for v in options(views, 2)] == ["b", "c"]


def test_the_judge_is_held_to_an_index_and_sees_every_option():
    request = ChatRequest(
        model="mesh",
        messages=[Message(role="system", content="Be brief."), Message(role="user", content="Q?")],
        temperature=0.9,
        max_tokens=500,
    )
    out = judge_request(request, ["first", "second", "third"], ModelInfo("big"))
    assert out.model == "big" and out.temperature == 0.0 and out.max_tokens == 16
    assert out.output_format is not None and out.output_format.json_schema == choice_schema(3)
    system = out.messages[0]
    assert system.role == "system" and system.content.startswith("Be brief.")
    assert "Candidate 3:\nthird" in system.content
    assert [m.role for m in out.messages] == ["system", "user"]
    assert out.reasoning is False and not out.tools


def test_read_choice_takes_only_an_index_in_range():
    assert read_choice('{"best": 2}', 3) == 1
    for bad in ('{"best": 4}', '{"best": 0}', '{"best": true}', '{"best": "1"}', "2", "nope", "[]"):
        assert read_choice(bad, 3) is None


# -- the arbiter --------------------------------------------------------------------------------


def test_agreeing_candidates_need_no_judge():
    arbiter = Arbiter(["a", "b", "c"], CONFIG, now=0.0)
    feed(arbiter, "a", "The answer is 4.", -0.5, 1.0)
    feed(arbiter, "b", "It is 4", -0.2, 1.1)
    decisions = feed(arbiter, "c", "4", -0.9, 1.2)
    assert decisions == [Commit("b", "agreement")]


def test_different_answers_go_to_the_judge_and_its_choice_wins():
    arbiter = Arbiter(["a", "b", "c"], CONFIG, now=0.0)
    feed(arbiter, "a", "Paris.", -0.5, 1.0)
    feed(arbiter, "b", "Lyon.", -0.2, 1.1)
    decisions = feed(arbiter, "c", "The answer is Paris.", -0.9, 1.2)
    (start,) = decisions
    assert isinstance(start, StartJudge) and start.fallback == "b"
    assert [name for name, _ in start.options] == ["b", "a"]  # c says what a says
    assert arbiter.handle(TokenArrived(JUDGE, '{"best": 2}'), 1.5) == []
    assert arbiter.handle(WorkerFinished(JUDGE, "stop"), 1.6) == [Commit("a", "judged")]


def test_a_judge_that_fails_or_names_nothing_leaves_the_most_confident():
    for ending in (WorkerFailed(JUDGE, "boom"), WorkerFinished(JUDGE, "stop")):
        arbiter = Arbiter(["a", "b"], CONFIG, now=0.0)
        feed(arbiter, "a", "Paris.", -0.5, 1.0)
        assert isinstance(feed(arbiter, "b", "Lyon.", -0.2, 1.1)[0], StartJudge)
        assert arbiter.handle(ending, 2.0) == [Commit("b", "judge-failed")]


def test_stragglers_get_grace_once_most_have_finished_then_are_stopped():
    arbiter = Arbiter(["a", "b", "c"], CONFIG, now=0.0)
    feed(arbiter, "a", "Paris.", -0.5, 1.0)
    assert feed(arbiter, "b", "Lyon.", -0.2, 1.5) == []  # most are in: c has until 3.5
    arbiter.handle(TokenArrived("c", "Still going"), 2.0)
    assert arbiter.next_deadline() == 3.5
    decisions = arbiter.tick(3.5)
    assert decisions[0] == Cancel("c") and isinstance(decisions[1], StartJudge)
    assert arbiter.stopped_early == 1


def test_without_the_pick_the_most_confident_stands():
    arbiter = Arbiter(["a", "b"], MoaConfig(policy="judge"), now=0.0)  # the default
    feed(arbiter, "a", "Paris.", -0.5, 1.0)
    assert feed(arbiter, "b", "Lyon.", -0.2, 1.1) == [Commit("b", "confidence")]


# -- through the orchestrator -------------------------------------------------------------------


def says(text: str, logprob: float) -> list[Step]:
    return [TextDelta(text, logprob=logprob), Done()]


async def test_judge_run_splices_the_chosen_sample_and_reports_it():
    upstream = ScriptedUpstream(
        scripts=[
            says("Paris.", -0.5),
            says("Lyon.", -0.1),
            says("Lyon!", -0.3),
            [Stall()],
            [TextDelta('{"best": 2}'), Done()],  # the judge
        ],
        name="local",
    )
    # Three answer; the fourth stalls until the grace after the majority, then is stopped.
    config = MoaConfig(
        grace_s=0.05, first_token_timeout_s=5.0, total_timeout_s=20.0, judge_pick=True
    )
    moa = MixtureOfAgents(mesh_of(("m", 1, upstream)), config)
    events = await collect(moa, ask(metadata={"moa_policy": "judge", "moa_samples": 4}))
    assert_well_formed(events)
    headers = meta_of(events)
    assert headers["x-moa-policy"] == "judge" and headers["x-moa-decision"] == "judged"
    assert headers["x-moa-options"] == "2" and headers["x-moa-stopped"] == "1"
    assert text_of(events) == "Paris."
    judge = upstream.requests[-1]
    assert judge.output_format is not None and judge.temperature == 0.0
    assert "Candidate 1:\nLyon." in judge.messages[0].content
    assert upstream.calls == 5 and upstream.active == 0
