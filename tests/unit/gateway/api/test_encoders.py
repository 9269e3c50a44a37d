"""Encoders against the official SDK types: any well-formed event sequence becomes frames that
validate strictly as the SDKs' stream events, and the pieces add up to the same answer."""

from __future__ import annotations

import anthropic._models as anthropic_models
import openai._models as openai_models
import orjson
from anthropic.types import RawMessageStreamEvent
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import ResponseStreamEvent
from openresponses import check_event

from gateway.api import chat, messages, messages_sse
from gateway.events import (
    Done,
    Error,
    Meta,
    Progress,
    ReasoningDelta,
    Sampling,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from gateway.responses import wire

piece = st.text(min_size=1, max_size=4)
content = st.lists(
    st.one_of(
        st.builds(TextDelta, piece), st.builds(ReasoningDelta, piece), st.builds(Progress, piece)
    ),
    max_size=8,
)
tools = st.lists(st.lists(st.text(max_size=4), min_size=1, max_size=3), max_size=2)
endings = st.sampled_from(
    [Done("stop"), Done("length"), Done("tool_calls"), Error(kind="upstream", message="x")]
)


# Where the Open Responses spec and OpenAI's SDK name events apart, the stream follows the spec:
# raw reasoning is ``response.reasoning.delta``/``.done`` (OpenAI: ``reasoning_text``) and the
# ``error`` event nests its payload (OpenAI: flat). The SDK has no type for those.
SPEC_ONLY_EVENTS = {"response.reasoning.delta", "response.reasoning.done", "error"}


def _events(deltas, calls, ending) -> list:
    events = list(deltas)
    for index, fragments in enumerate(calls):
        events.append(
            ToolCallDelta(index, id=f"call_{index}", name=f"tool{index}", arguments=fragments[0])
        )
        events += [ToolCallDelta(index, arguments=f) for f in fragments[1:]]
    # What a worker sends at its end: the usage, the sampling it used, the terminal.
    return [*events, Usage(4, len(events), 1), Sampling(0.2, 0.9), ending]


def _frames(raw: bytes) -> list[tuple[str | None, str]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            lines = dict(line.split(": ", 1) for line in block.split("\n"))
            out.append((lines.get("event"), lines["data"]))
    return out


def _encode(module, encoder_cls, body: dict, events: list) -> list[tuple[str | None, str]]:
    request, parsed = module.parse(body)
    encoder = encoder_cls(request, parsed)
    raw = encoder.start() + b"".join(encoder.encode(e) for e in events)
    return _frames(raw)


def _private_keys(value) -> list[str]:
    """Keys starting with "_" anywhere in a payload: internal state leaking onto the wire."""
    if isinstance(value, dict):
        return [k for k in value if k.startswith("_")] + [
            p for v in value.values() for p in _private_keys(v)
        ]
    if isinstance(value, list):
        return [p for v in value for p in _private_keys(v)]
    return []


def _expected_text(events, kind) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


@settings(max_examples=40, deadline=None)
@given(content, tools, endings)
def test_chat_chunks_validate_and_add_up(deltas, calls, ending):
    events = _events(deltas, calls, ending)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "stream_options": {"include_usage": True},
    }
    frames = _encode(chat, chat.ChatStreamEncoder, body, events)
    assert not [k for _, d in frames[:-1] for k in _private_keys(orjson.loads(d))]
    assert frames[-1][1] == "[DONE]"
    payloads = [orjson.loads(d) for _, d in frames[:-1]]
    if isinstance(ending, Error):
        assert "error" in payloads[-1]
        payloads = payloads[:-1]
    chunks = [openai_models.validate_type(type_=ChatCompletionChunk, value=p) for p in payloads]
    with_choice = [c for c in chunks if c.choices]
    assert [c.choices[0].delta.role for c in with_choice[:1]] in ([], ["assistant"])
    assert all(c.choices[0].delta.role is None for c in with_choice[1:])
    assert "".join(c.choices[0].delta.content or "" for c in with_choice) == _expected_text(
        events, TextDelta
    )
    # Progress notes have no channel here: reasoning is the model's alone.
    reasoning = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in with_choice
    )
    assert reasoning == _expected_text(events, ReasoningDelta)
    seen: set[int] = set()
    args: dict[int, str] = {}
    for fragment in (tc for c in with_choice for tc in c.choices[0].delta.tool_calls or []):
        first = fragment.index not in seen
        seen.add(fragment.index)
        assert (fragment.id is not None) == first and (fragment.function.name is not None) == first
        args[fragment.index] = args.get(fragment.index, "") + fragment.function.arguments
    assert args == {i: "".join(f) for i, f in enumerate(calls)}
    if isinstance(ending, Done):
        assert (
            chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens == 1
        )
        finish = with_choice[-1].choices[0].finish_reason
        assert finish == (
            "tool_calls" if calls and ending.finish_reason == "stop" else ending.finish_reason
        )


@settings(max_examples=40, deadline=None)
@given(content, tools, endings)
def test_responses_events_validate_and_add_up(deltas, calls, ending):
    events = _events(deltas, calls, ending)
    frames = _encode(wire, wire.ResponsesStreamEncoder, {"model": "m", "input": "x"}, events)
    payloads = [orjson.loads(d) for _, d in frames]
    for payload in payloads:
        check_event(payload)  # the Open Responses spec, which the stream follows
    assert [name for name, _ in frames] == [p["type"] for p in payloads]
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    # And OpenAI's SDK, for every event it has a type for.
    parsed = [
        openai_models.validate_type(type_=ResponseStreamEvent, value=p)
        for p in payloads
        if p["type"] not in SPEC_ONLY_EVENTS
    ]
    added = [p.item.id for p in parsed if p.type == "response.output_item.added"]
    done = [p.item.id for p in parsed if p.type == "response.output_item.done"]
    assert added == done and len(set(added)) == len(added)
    final = parsed[-1]
    if isinstance(ending, Error):
        assert [p["type"] for p in payloads[-2:]] == ["error", "response.failed"]
        assert final.response.status == "failed" and final.response.error.code == "server_error"
        return
    assert final.type == (
        "response.incomplete" if ending.finish_reason == "length" else "response.completed"
    )
    assert final.response.output_text == _expected_text(events, TextDelta)
    # The request left them out: the response states the values the worker used.
    assert (final.response.temperature, final.response.top_p) == (0.2, 0.9)
    streamed = "".join(p.delta for p in parsed if p.type == "response.output_text.delta")
    assert streamed == final.response.output_text
    # Progress notes become reasoning summaries, never reasoning content.
    reasoning_items = [i for i in final.response.output if i.type == "reasoning"]
    summaries = "".join(s.text for i in reasoning_items for s in i.summary)
    assert summaries == _expected_text(events, Progress)
    thought = "".join(c.text for i in reasoning_items for c in i.content or [])
    assert thought == _expected_text(events, ReasoningDelta)
    summary_deltas = "".join(
        p.delta for p in parsed if p.type == "response.reasoning_summary_text.delta"
    )
    assert summary_deltas == summaries
    calls_out = [i for i in final.response.output if i.type == "function_call"]
    assert [c.arguments for c in calls_out] == ["".join(f) for f in calls]
    assert len({p.response.id for p in parsed if hasattr(p, "response")}) == 1


@settings(max_examples=40, deadline=None)
@given(content, tools, endings)
def test_anthropic_events_validate_and_add_up(deltas, calls, ending):
    events = _events(deltas, calls, ending)
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    frames = _encode(messages, messages_sse.MessagesStreamEncoder, body, events)
    assert not [k for _, d in frames for k in _private_keys(orjson.loads(d))]
    if isinstance(ending, Error):
        assert frames[-1][0] == "error" and orjson.loads(frames[-1][1])["type"] == "error"
        frames = frames[:-1]
    parsed = [
        anthropic_models.validate_type(type_=RawMessageStreamEvent, value=orjson.loads(d))
        for _, d in frames
    ]
    assert [name for name, _ in frames] == [p.type for p in parsed]
    starts = [p.index for p in parsed if p.type == "content_block_start"]
    stops = [p.index for p in parsed if p.type == "content_block_stop"]
    assert starts == list(range(len(starts)))
    text = "".join(
        p.delta.text
        for p in parsed
        if p.type == "content_block_delta" and p.delta.type == "text_delta"
    )
    assert text == _expected_text(events, TextDelta)
    thinking = "".join(
        p.delta.thinking
        for p in parsed
        if p.type == "content_block_delta" and p.delta.type == "thinking_delta"
    )
    assert thinking == _expected_text(events, ReasoningDelta)  # Progress notes are dropped
    if isinstance(ending, Done):
        assert stops == starts and parsed[-1].type == "message_stop"
        stop_reason = parsed[-2].delta.stop_reason
        assert stop_reason == (
            "max_tokens"
            if ending.finish_reason == "length"
            else "tool_use"
            if calls or ending.finish_reason == "tool_calls"
            else "end_turn"
        )


def test_anthropic_message_start_waits_for_the_first_event():
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    request, parsed = messages.parse(body)
    encoder = messages_sse.MessagesStreamEncoder(request, parsed)
    assert encoder.start() == b""
    ping = _frames(encoder.keepalive())
    assert [name for name, _ in ping] == ["ping"]  # a ping may come first; no message yet
    # A route fact arriving first (a retry's peer, x-tools-listing) is for headers: it must not
    # start the message with zero usage before the prompt count comes.
    assert encoder.encode(Meta({"x-tools-listing": "names"})) == b""
    frames = _frames(encoder.encode(Usage(12, 0, 0)) + encoder.encode(TextDelta("hi")))
    names = [name for name, _ in frames]
    assert names == ["message_start", "content_block_start", "content_block_delta"]
    assert orjson.loads(frames[0][1])["message"]["usage"]["input_tokens"] == 12
    # A stream that fails before any event is just the error, no message around it.
    failing = messages_sse.MessagesStreamEncoder(request, parsed)
    failing.start()
    frames = _frames(failing.encode(Error(kind="upstream", message="x")))
    assert [name for name, _ in frames] == ["error"]
