"""Several answers to one request (Chat ``n > 1``): the merge (pure), per-choice seeds, usage
summed the OpenAI way, and the fan-out's cancellation over scripted upstreams."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from gateway.answer import Accumulator
from gateway.api.chat import ChatStreamEncoder, completion_body, parse
from gateway.choices import ChoiceMerger, choice_request, fan_out, merged_usage
from gateway.events import ChoiceEvent, Done, Error, Event, Meta, TextDelta, Usage
from gateway.request import INT64_MAX
from gateway.testing import ScriptedUpstream, Stall, chat_request, text_script


def test_choice_seeds_move_on_by_index_and_choice_zero_keeps_the_callers() -> None:
    request = chat_request(seed=7)
    assert [choice_request(request, i).seed for i in range(3)] == [7, 8, 9]
    assert choice_request(chat_request(), 2).seed is None  # unseeded stays unseeded
    top = chat_request(seed=INT64_MAX)
    assert choice_request(top, 2).seed == INT64_MAX - 2  # never past int64


def test_usage_counts_the_prompt_once_and_sums_the_completions() -> None:
    usage = merged_usage([Usage(100, 5, 0), Usage(100, 7, 99), Usage(100, 3, 99)])
    assert usage == Usage(prompt_tokens=100, completion_tokens=15, cached_tokens=0)


def test_the_merge_wraps_each_choice_and_ends_once_all_have() -> None:
    merger = ChoiceMerger(2)
    assert merger.feed(0, Meta({"x-route": "local"})) == [Meta({"x-route": "local"})]
    assert merger.feed(1, TextDelta("b")) == [ChoiceEvent(1, TextDelta("b"))]
    assert merger.feed(0, Usage(9, 1)) == [ChoiceEvent(0, Usage(9, 1))]
    assert merger.feed(0, Done("length")) == [ChoiceEvent(0, Done("length"))]
    assert merger.feed(0, None) == []
    assert merger.feed(1, Usage(9, 2)) == [ChoiceEvent(1, Usage(9, 2))]
    assert merger.feed(1, Done()) == [ChoiceEvent(1, Done())]
    assert merger.feed(1, None) == [Usage(9, 3), Done()]
    assert merger.over


def test_the_first_failing_choice_fails_the_request() -> None:
    merger = ChoiceMerger(3)
    merger.feed(0, TextDelta("a"))
    error = Error(kind="upstream", message="worker died")
    assert merger.feed(1, error) == [error]
    assert merger.over and merger.feed(2, TextDelta("late")) == []
    broke = ChoiceMerger(2)
    (event,) = broke.feed(1, None)  # ended without its terminal event
    assert isinstance(event, Error) and event.kind == "upstream"


async def collect(stream) -> list[Event]:
    return [event async for event in stream]


async def test_fan_out_runs_one_call_per_choice_with_its_seed() -> None:
    upstream = ScriptedUpstream.of(*text_script("hi", usage=Usage(5, 1, 2)))
    events = await collect(fan_out(chat_request(seed=1), 3, upstream.stream))
    assert [r.seed for r in upstream.requests] == [1, 2, 3]
    assert events[-2:] == [Usage(5, 3, 2), Done()]
    assert sorted(e.index for e in events if isinstance(e, ChoiceEvent) and e.event == Done()) == [
        0,
        1,
        2,
    ]


async def test_closing_the_fan_out_closes_every_call() -> None:
    upstream = ScriptedUpstream.of(TextDelta("a"), Stall())
    stream = fan_out(chat_request(), 3, upstream.stream)
    assert isinstance(await anext(stream), ChoiceEvent)
    await stream.aclose()  # the client went away
    assert upstream.active == 0 and upstream.cancelled == 3


async def test_a_failing_choice_closes_its_siblings() -> None:
    scripts = [[TextDelta("a"), Stall()], [Error(kind="upstream", message="gone")]]
    upstream = ScriptedUpstream(scripts=scripts)
    events = await asyncio.wait_for(collect(fan_out(chat_request(), 3, upstream.stream)), 10)
    assert events[-1] == Error(kind="upstream", message="gone")
    assert upstream.active == 0


def _feed(events: list[Event]) -> Accumulator:
    acc = Accumulator()
    for event in events:
        acc.add(event)
    return acc


def test_the_chat_body_has_a_choice_per_index_and_the_whole_usage() -> None:
    request, _ = parse({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2})
    events: list[Event] = [
        ChoiceEvent(1, TextDelta("second")),
        ChoiceEvent(0, TextDelta("first")),
        ChoiceEvent(1, Done("length")),
        ChoiceEvent(0, Done()),
        Usage(4, 6, 0),
        Done(),
    ]
    body = completion_body(request, _feed(events))
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "first", "stop"),
        (1, "second", "length"),
    ]
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 6


def test_the_chat_stream_tags_each_chunk_with_its_choice() -> None:
    raw = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request, body = parse(raw)
    encoder = ChatStreamEncoder(request, body)
    events: list[Event] = [
        ChoiceEvent(0, TextDelta("a")),
        ChoiceEvent(1, TextDelta("b")),
        ChoiceEvent(1, Done()),
        ChoiceEvent(0, Done("length")),
        Usage(4, 2, 0),
        Done(),
    ]
    frames = b"".join(encoder.encode(e) for e in events).split(b"\n\n")
    chunks = [orjson.loads(f[6:]) for f in frames if f.startswith(b"data: {")]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert [(c["index"], c["delta"], c["finish_reason"]) for c in choices] == [
        (0, {"role": "assistant", "content": "a"}, None),
        (1, {"role": "assistant", "content": "b"}, None),
        (1, {}, "stop"),
        (0, {}, "length"),
    ]
    assert chunks[-1]["usage"]["completion_tokens"] == 2
    assert frames[-2] == b"data: [DONE]"


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_a_400(n: int) -> None:
    from gateway.refusals import RequestInvalid

    with pytest.raises(RequestInvalid):
        parse({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": n})
