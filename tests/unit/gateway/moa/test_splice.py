"""The MoA orchestrator with scripted workers at controlled speeds: live splicing, cancellation of
losers, thinking knobs on every worker call, and failures that never hang the client's stream."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.events import (
    Done,
    Error,
    Event,
    Meta,
    Progress,
    ReasoningDelta,
    TextDelta,
    Usage,
    is_terminal,
)
from gateway.moa import MixtureOfAgents, MoaConfig
from gateway.request import ChatRequest, Message
from gateway.testing import Raise, ScriptedUpstream, Sleep, Stall, Step, chat_request
from gateway.upstream import ModelInfo, StaticDirectory

# N-token race semantics, so tests control exactly when the race decides.
FAST = MoaConfig(
    race_min_tokens=4,
    race_early_commit=False,
    grace_s=0.2,
    first_token_timeout_s=5.0,
    total_timeout_s=20.0,
)


def paced(
    text: str, *, chunk: int = 2, every: float = 0.005, ttft: float = 0.0, end: bool = True
) -> list[Step]:
    """``text`` in chunks, ``every`` seconds apart after a first-token delay ``ttft``."""
    steps: list[Step] = [Sleep(ttft)] if ttft else []
    for i in range(0, len(text), chunk):
        steps += [TextDelta(text[i : i + chunk]), Sleep(every)]
    if end:
        steps += [Usage(prompt_tokens=5, completion_tokens=len(text) // chunk), Done()]
    return steps


def mesh_of(*workers: tuple[str, int, ScriptedUpstream]) -> StaticDirectory:
    directory = StaticDirectory()
    for model_id, params, upstream in workers:
        directory.add(ModelInfo(model_id, parameters=params), upstream)
    return directory


def ask(**fields) -> ChatRequest:
    return ChatRequest(model="mesh", messages=[Message(role="user", content="Q?")], **fields)


async def collect(
    moa: MixtureOfAgents, request: ChatRequest, limit: float = 10.0
) -> list[tuple[float, Event]]:
    """Every event with its arrival time (seconds since the call); fails if it takes too long."""
    out: list[tuple[float, Event]] = []
    start = time.monotonic()
    async with asyncio.timeout(limit):
        async for event in moa.stream(request):
            out.append((time.monotonic() - start, event))
    return out


def text_of(events) -> str:
    return "".join(e.text for _, e in events if isinstance(e, TextDelta))


def meta_of(events) -> dict[str, str]:
    """Every Meta merged (the opening one with policy and workers, then the decision's)."""
    metas = [e for _, e in events if isinstance(e, Meta)]
    opening = set(metas[0].headers) - {"x-moa-auto", "x-moa-vote-schedule"} if metas else set()
    assert opening == {"x-moa-policy", "x-moa-workers"}
    return {k: v for m in metas for k, v in m.headers.items()}


def moa_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("moa-") and not t.done()]


def assert_well_formed(events) -> None:
    """The opening Meta first; one terminal, last; no text before the decision's Meta."""
    kinds = [e for _, e in events]
    assert isinstance(kinds[0], Meta) or isinstance(kinds[0], Error)
    assert sum(is_terminal(e) for e in kinds) == 1 and is_terminal(kinds[-1])
    first_text = next((i for i, e in enumerate(kinds) if isinstance(e, TextDelta)), None)
    if first_text is not None:
        decision = next(
            i for i, e in enumerate(kinds) if isinstance(e, Meta) and "x-moa-winner" in e.headers
        )
        assert decision < first_text


# -- splicing ------------------------------------------------------------------------------------


async def test_first_text_arrives_and_stream_ends_while_the_slowest_worker_never_finishes():
    fast = ScriptedUpstream.of(*paced("The sky is blue today."))
    stuck = ScriptedUpstream.of(TextDelta("The"), Stall())
    late = ScriptedUpstream.of(Sleep(30), *paced("Too late."))
    moa = MixtureOfAgents(mesh_of(("a", 1, fast), ("b", 2, stuck), ("c", 3, late)), FAST)
    events = await collect(moa, ask())
    assert_well_formed(events)
    assert text_of(events) == "The sky is blue today."
    assert isinstance(events[-1][1], Done)
    assert meta_of(events)["x-moa-winner"] == "a"
    # Losers were cancelled, not left running; the winner ran to its end.
    assert (fast.completed, fast.cancelled) == (1, 0)
    for loser in (stuck, late):
        assert (loser.completed, loser.cancelled, loser.active) == (0, 1, 0)
    assert moa_tasks() == []


async def test_spliced_stream_equals_the_winners_stream_event_for_event():
    text = "Grüße, 世界! 🌍 The answer is 42 – surely.\n"
    script = paced(text, chunk=3)
    winner = ScriptedUpstream.of(*script)
    other = ScriptedUpstream.of(*paced("Another answer entirely.", ttft=0.5))
    moa = MixtureOfAgents(mesh_of(("w", 1, winner), ("o", 2, other)), FAST)
    events = await collect(moa, ask())
    assert text_of(events).encode() == text.encode()
    after_meta = [e for _, e in events if not isinstance(e, Meta)]
    assert after_meta == [s for s in script if not isinstance(s, Sleep)]


async def test_deltas_are_spread_over_the_winners_generation_not_one_burst():
    every, pieces = 0.02, 30
    text = "".join(f"w{i:02d} " for i in range(pieces))
    winner = ScriptedUpstream.of(*paced(text, chunk=4, every=every))
    other = ScriptedUpstream.of(Sleep(5), *paced("slow"))
    moa = MixtureOfAgents(mesh_of(("w", 1, winner), ("o", 2, other)), FAST)
    events = await collect(moa, ask())
    times = [t for t, e in events if isinstance(e, TextDelta)]
    assert len(times) == pieces
    # The race decides after 4 deltas; the remaining 26 follow the script's pace: each is
    # separated by at least one sleep, so the span can only be longer under load, never shorter.
    live = pieces - FAST.race_min_tokens
    assert times[-1] - times[0] >= 0.5 * live * every
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert sum(g >= every / 2 for g in gaps) >= live // 2


async def test_default_race_commits_on_a_conclusive_first_delta():
    quick = ScriptedUpstream.of(TextDelta("The"), Sleep(0.3), *paced(" sky is blue."))
    hesitant = ScriptedUpstream.of(TextDelta("I"), Stall())
    moa = MixtureOfAgents(mesh_of(("q", 1, quick), ("h", 2, hesitant)), MoaConfig())
    events = await collect(moa, ask())
    # The first delta went out before the quick worker's pause ended, not after 4 deltas.
    first_text = next(t for t, e in events if isinstance(e, TextDelta))
    assert first_text < events[-1][0] - 0.2
    assert text_of(events) == "The sky is blue." and meta_of(events)["x-moa-winner"] == "q"
    assert hesitant.cancelled == 1


async def test_meta_headers_and_optional_progress_precede_any_text():
    a = ScriptedUpstream.of(*paced("Alpha beta gamma"))
    b = ScriptedUpstream.of(*paced("Delta", ttft=0.3))
    config = MoaConfig(race_min_tokens=2, race_early_commit=False, progress=True)
    events = await collect(MixtureOfAgents(mesh_of(("a", 1, a), ("b", 2, b)), config), ask())
    assert_well_formed(events)
    # The opening Meta precedes the progress note, so its facts can reach the headers in time.
    assert events[0][1] == Meta({"x-moa-policy": "race", "x-moa-workers": "2"})
    assert events[1][1] == Progress("asking 2 models…")
    # A note, not reasoning: the only text the client gets is the winner's.
    assert not any(isinstance(e, ReasoningDelta) for _, e in events)
    headers = meta_of(events)
    assert headers["x-moa-policy"] == "race" and headers["x-moa-workers"] == "2"
    assert headers["x-moa-winner"] == "a" and headers["x-moa-decision"] == "race"
    assert float(headers["x-moa-decision-ms"]) >= 0


async def test_self_mixture_race_prefers_the_callers_sample_over_a_faster_hot_one():
    # Call order is sample order: #0 (caller's temperature) is a little slower than #1 (hot).
    solo = ScriptedUpstream(
        scripts=[paced("The caller's answer.", ttft=0.05), paced("A hot answer."), [Stall()]]
    )
    config = dataclasses.replace(FAST, race_prefer_window_s=5.0)
    events = await collect(MixtureOfAgents(mesh_of(("solo", 1, solo)), config), ask())
    assert_well_formed(events)
    assert meta_of(events)["x-moa-winner"] == "solo#0"
    assert text_of(events) == "The caller's answer."
    # Distinct models have no caller's sample: the first passer wins at once.
    fast, slow = (
        ScriptedUpstream.of(*paced("Fast.")),
        ScriptedUpstream.of(*paced("Slow.", ttft=0.05)),
    )
    events = await collect(MixtureOfAgents(mesh_of(("a", 2, slow), ("b", 1, fast)), config), ask())
    assert meta_of(events)["x-moa-winner"] == "b"


# -- thinking knobs ------------------------------------------------------------------------------


async def test_thinking_off_reaches_every_worker_call_including_self_mixture_samples():
    multi = [ScriptedUpstream.of(*paced("answer")) for _ in range(3)]
    solo = ScriptedUpstream.of(*paced("answer"))
    for directory in (
        mesh_of(*((f"m{i}", i, u) for i, u in enumerate(multi))),
        mesh_of(("solo", 1, solo)),
    ):
        await collect(MixtureOfAgents(directory, FAST), ask())
    requests = [r for u in (*multi, solo) for r in u.requests]
    assert len(requests) == 6
    for request in requests:
        assert request.reasoning is False and request.reasoning_effort == "none"
        assert request.chat_template_kwargs["enable_thinking"] is False


@pytest.mark.parametrize(
    "knob",
    [
        {"reasoning": True},
        {"reasoning_effort": "medium"},
        {"chat_template_kwargs": {"enable_thinking": True}},
        {"chat_template_kwargs": {"thinking": True}},
        {"chat_template_kwargs": {"thinking_budget": 1024}},
    ],
)
async def test_each_opt_in_knob_reaches_every_worker(knob):
    workers = [ScriptedUpstream.of(*paced("answer")) for _ in range(3)]
    moa = MixtureOfAgents(mesh_of(*((f"m{i}", i, u) for i, u in enumerate(workers))), FAST)
    await collect(moa, chat_request(content="Q?", **knob))  # normalised at the edge
    for upstream in workers:
        (request,) = upstream.requests
        assert request.reasoning is True
        assert request.chat_template_kwargs["enable_thinking"] is True


# -- cancellation ----------------------------------------------------------------------------------


async def test_client_disconnect_before_commit_cancels_every_worker():
    workers = [ScriptedUpstream.of(TextDelta("x"), Stall()) for _ in range(3)]
    moa = MixtureOfAgents(
        mesh_of(*((f"m{i}", i, u) for i, u in enumerate(workers))),
        MoaConfig(progress=True, race_min_tokens=50),
    )
    stream = moa.stream(ask())
    assert isinstance(await anext(stream), Meta)
    assert isinstance(await anext(stream), Progress)
    await asyncio.sleep(0.05)  # the workers are streaming now
    assert all(u.active == 1 for u in workers)
    await stream.aclose()
    assert all((u.active, u.cancelled) == (0, 1) for u in workers)
    assert moa_tasks() == []


async def test_cancelling_the_consumer_task_cancels_every_worker():
    workers = [ScriptedUpstream.of(Stall()) for _ in range(3)]
    moa = MixtureOfAgents(mesh_of(*((f"m{i}", i, u) for i, u in enumerate(workers))), FAST)
    consumer = asyncio.create_task(collect(moa, ask()))
    await asyncio.sleep(0.05)
    assert all(u.active == 1 for u in workers)
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    assert all((u.active, u.cancelled) == (0, 1) for u in workers)
    assert moa_tasks() == []


async def test_client_disconnect_after_commit_cancels_the_winner():
    winner = ScriptedUpstream.of(*paced("a b c d e f g h"), Stall())
    loser = ScriptedUpstream.of(Sleep(10), *paced("late"))
    moa = MixtureOfAgents(mesh_of(("w", 1, winner), ("l", 2, loser)), FAST)
    stream = moa.stream(ask())
    async for event in stream:
        if isinstance(event, TextDelta):
            break
    await stream.aclose()
    assert (winner.active, winner.cancelled, loser.active, loser.cancelled) == (0, 1, 0, 1)
    assert moa_tasks() == []


# -- failures --------------------------------------------------------------------------------------


async def test_broken_workers_are_skipped():
    raises = ScriptedUpstream.of(Raise(ConnectionResetError("peer reset")))
    errors = ScriptedUpstream.of(Error("overloaded", "busy", retryable=True))
    eof = ScriptedUpstream.of(TextDelta("half"))  # ends without a terminal event
    good = ScriptedUpstream.of(*paced("Fine answer.", ttft=0.1))
    directory = mesh_of(("r", 4, raises), ("e", 3, errors), ("f", 2, eof), ("g", 1, good))
    config = MoaConfig(max_workers=4, race_early_commit=False)
    events = await collect(MixtureOfAgents(directory, config), ask())
    assert_well_formed(events)
    assert text_of(events) == "Fine answer." and isinstance(events[-1][1], Done)
    assert meta_of(events)["x-moa-decision"] == "survivor"


async def test_all_workers_failing_ends_with_one_error():
    directory = mesh_of(
        ("r", 2, ScriptedUpstream.of(Raise(RuntimeError("boom")))),
        ("e", 1, ScriptedUpstream.of(Sleep(0.05), Error("upstream", "bad gateway"))),
    )
    events = await collect(MixtureOfAgents(directory, FAST), ask())
    assert_well_formed(events)
    error = events[-1][1]
    assert isinstance(error, Error) and error.kind == "upstream"


async def test_all_workers_hanging_ends_with_a_timeout_error():
    workers = [ScriptedUpstream.of(Stall()) for _ in range(2)]
    config = MoaConfig(first_token_timeout_s=0.2)
    moa = MixtureOfAgents(mesh_of(*((f"m{i}", i, u) for i, u in enumerate(workers))), config)
    events = await collect(moa, ask())
    assert [type(e) for _, e in events] == [Meta, Error]
    assert events[1][1].kind == "timeout"
    assert all(u.cancelled == 1 and u.active == 0 for u in workers)


@pytest.mark.parametrize("others", [[Raise(RuntimeError("boom"))], []])
async def test_a_silent_last_worker_still_has_its_first_token_deadline(others):
    # The other worker fails at once (or there is none: the single worker is committed at
    # start): the silent one must not get total_timeout_s to say its first word.
    silent = ScriptedUpstream.of(Stall())
    workers = [("s", 1, silent)] + ([("f", 2, ScriptedUpstream.of(*others))] if others else [])
    config = MoaConfig(max_workers=len(workers), first_token_timeout_s=0.2, total_timeout_s=60.0)
    events = await collect(MixtureOfAgents(mesh_of(*workers), config), ask(), limit=5.0)
    assert_well_formed(events)
    error = events[-1][1]
    assert isinstance(error, Error) and "no first token" in error.message
    assert error.kind == ("upstream" if others else "timeout")  # not every failure timed out
    assert silent.cancelled == 1 and silent.active == 0


@pytest.mark.parametrize(
    ("tail", "kind"),
    [
        ([Error("upstream", "worker died")], "upstream"),
        ([Raise(ConnectionResetError("gone"))], "upstream"),
        ([Stall()], "timeout"),
    ],
)
async def test_a_winner_that_fails_after_commit_ends_the_stream_with_an_error(tail, kind):
    winner = ScriptedUpstream.of(*paced("partial answer", end=False), *tail)
    loser = ScriptedUpstream.of(Sleep(10), *paced("late"))
    config = MoaConfig(race_min_tokens=2, race_early_commit=False, total_timeout_s=0.5)
    events = await collect(
        MixtureOfAgents(mesh_of(("w", 1, winner), ("l", 2, loser)), config), ask()
    )
    assert_well_formed(events)
    assert text_of(events) == "partial answer"
    assert isinstance(events[-1][1], Error) and events[-1][1].kind == kind


async def test_no_models_and_unknown_policy_are_clear_errors():
    events = await collect(MixtureOfAgents(StaticDirectory(), FAST), ask())
    assert [e.kind for _, e in events] == ["unavailable"]  # type: ignore[attr-defined]
    moa = MixtureOfAgents(mesh_of(("a", 1, ScriptedUpstream.of(*paced("x")))), FAST)
    events = await collect(moa, ask(metadata={"moa_policy": "judge-o-matic"}))
    assert [e.kind for _, e in events] == ["invalid_request"]  # type: ignore[attr-defined]


# -- policies through the orchestrator -----------------------------------------------------------


async def test_consensus_commits_to_agreeing_workers_and_splices_live():
    a = ScriptedUpstream.of(*paced("The capital of France is Paris.", every=0.02))
    b = ScriptedUpstream.of(*paced("The capital of France is Paris!", every=0.03))
    c = ScriptedUpstream.of(*paced("Lyon, I believe.", every=0.01))
    config = MoaConfig(policy="consensus", agree_prefix_chars=20, grace_s=5.0)
    moa = MixtureOfAgents(mesh_of(("a", 3, a), ("b", 2, b), ("c", 1, c)), config)
    events = await collect(moa, ask())
    assert_well_formed(events)
    headers = meta_of(events)
    assert headers["x-moa-decision"] == "agreement" and headers["x-moa-winner"] in ("a", "b")
    winner = {"a": a, "b": b}[headers["x-moa-winner"]]
    assert winner.completed == 1
    assert text_of(events) == f"The capital of France is Paris{'.' if winner is a else '!'}"


async def test_per_request_policy_overrides_the_configured_one():
    a = ScriptedUpstream.of(*paced("Quick answer here"))
    b = ScriptedUpstream.of(*paced("Slow answer there", every=0.02))
    moa = MixtureOfAgents(mesh_of(("a", 1, a), ("b", 2, b)), FAST)
    events = await collect(moa, ask(metadata={"moa_policy": "consensus"}))
    assert meta_of(events)["x-moa-policy"] == "consensus"
    assert "moa_policy" not in a.requests[0].metadata


async def test_reduce_runs_the_aggregator_on_the_strongest_model_and_streams_it_live():
    big = ScriptedUpstream(
        scripts=[paced("Lyon.", ttft=0.05), paced("Paris is the capital.", every=0.02)]
    )
    small = ScriptedUpstream.of(*paced("Paris."))
    config = MoaConfig(policy="reduce", grace_s=5.0)
    moa = MixtureOfAgents(mesh_of(("small", 135, small), ("big", 1700, big)), config)
    events = await collect(moa, ask())
    assert_well_formed(events)
    assert meta_of(events)["x-moa-winner"] == "reducer"
    assert text_of(events) == "Paris is the capital."
    reducer_request = big.requests[1]
    assert reducer_request.model == "big"
    system = reducer_request.messages[0].content
    assert "Paris." in system and "Lyon." in system
    assert reducer_request.chat_template_kwargs["enable_thinking"] is False


async def test_reduce_falls_back_to_the_best_answer_when_the_aggregator_fails():
    big = ScriptedUpstream(
        scripts=[paced("Lyon."), [Raise(ConnectionResetError("aggregator died"))]]
    )
    small = ScriptedUpstream.of(*paced("Paris."))
    config = MoaConfig(policy="reduce", grace_s=5.0)
    events = await collect(
        MixtureOfAgents(mesh_of(("small", 1, small), ("big", 2, big)), config), ask()
    )
    assert_well_formed(events)
    assert meta_of(events)["x-moa-decision"] == "reducer-failed"
    assert text_of(events) in ("Paris.", "Lyon.") and isinstance(events[-1][1], Done)


async def test_wins_are_remembered_per_model():
    a = ScriptedUpstream.of(*paced("Quick answer here"))
    b = ScriptedUpstream.of(*paced("Slow answer there", ttft=0.2))
    moa = MixtureOfAgents(mesh_of(("a", 1, a), ("b", 2, b)), FAST)
    for _ in range(2):
        await collect(moa, ask())
    assert moa.wins.rate("a") > moa.wins.rate("b")


# -- random failures never hang the client (hypothesis) -----------------------------------------

ENDINGS = ["done", "error", "raise", "stall", "eof"]


@st.composite
def worker_scripts(draw) -> list[Step]:
    steps: list[Step] = [Sleep(draw(st.sampled_from([0.0, 0.01, 0.05])))]
    for i in range(draw(st.integers(0, 6))):
        steps += [TextDelta(f"t{i} "), Sleep(draw(st.sampled_from([0.0, 0.005, 0.02])))]
    ending = draw(st.sampled_from(ENDINGS))
    steps += {
        "done": [Done()],
        "error": [Error("upstream", "worker died")],
        "raise": [Raise(ConnectionResetError("reset"))],
        "stall": [Stall()],
        "eof": [],
    }[ending]
    return steps


@given(
    scripts=st.lists(worker_scripts(), min_size=1, max_size=3),
    policy=st.sampled_from(["race", "consensus", "reduce"]),
    disconnect_after=st.one_of(st.none(), st.integers(0, 4)),
    max_workers=st.integers(1, 3),
)
@settings(max_examples=25, deadline=None)
def test_random_faults_never_hang_the_client_stream(scripts, policy, disconnect_after, max_workers):
    config = MoaConfig(
        policy=policy,
        max_workers=max_workers,
        race_min_tokens=2,
        grace_s=0.05,
        first_token_timeout_s=0.15,
        total_timeout_s=0.4,
    )
    upstreams = [ScriptedUpstream.of(*s) for s in scripts]
    directory = mesh_of(*((f"m{i}", i, u) for i, u in enumerate(upstreams)))

    async def scenario() -> None:
        moa = MixtureOfAgents(directory, config)
        events: list[Event] = []
        stream = moa.stream(ask())
        async with asyncio.timeout(5):
            async for event in stream:
                events.append(event)
                if disconnect_after is not None and len(events) > disconnect_after:
                    break
            await stream.aclose()
        assert all(u.active == 0 for u in upstreams)
        assert moa_tasks() == []
        if disconnect_after is not None and len(events) > disconnect_after:
            return
        timed = [(0.0, e) for e in events]
        assert_well_formed(timed)
        if isinstance(events[-1], Done):
            winner = meta_of(timed)["x-moa-winner"]
            index = len(upstreams) - 1 if winner == "reducer" else int(winner[1:].split("#")[0])
            expected = "".join(s.text for s in scripts[index] if isinstance(s, TextDelta))
            assert text_of(timed) == expected

    asyncio.run(scenario())


@pytest.mark.parametrize("policy", ["race", "consensus", "reduce"])
async def test_a_single_worker_is_passed_straight_through(policy):
    script = paced("Only me, streaming.", chunk=1)
    solo = ScriptedUpstream.of(*script)
    config = MoaConfig(policy=policy, max_workers=1)
    events = await collect(MixtureOfAgents(mesh_of(("solo", 1, solo)), config), ask())
    assert meta_of(events)["x-moa-decision"] == "single"
    assert [e for _, e in events if not isinstance(e, Meta)] == [
        s for s in script if not isinstance(s, Sleep)
    ]
