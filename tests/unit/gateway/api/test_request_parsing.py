"""Each API's body → ChatRequest: thinking knobs, max tokens, tools, message placement."""

from __future__ import annotations

import pytest

from gateway.api import chat, messages
from gateway.api.common import place_system_messages
from gateway.refusals import RequestInvalid
from gateway.request import Message
from gateway.responses import wire

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, None),
        ({"reasoning_effort": "none"}, False),
        ({"reasoning_effort": "high"}, True),
        ({"chat_template_kwargs": {"enable_thinking": False}}, False),
        ({"enable_thinking": True}, True),
    ],
)
def test_chat_thinking_knobs(extra, expected):
    request, _ = chat.parse({"model": "m", "messages": USER, **extra})
    assert request.reasoning is expected


def test_responses_and_messages_thinking_knobs():
    assert (
        wire.parse({"model": "m", "input": "x", "reasoning": {"effort": "low"}})[0].reasoning
        is True
    )
    assert wire.parse({"model": "m", "input": "x"})[0].reasoning is None
    body = {"model": "m", "max_tokens": 5, "messages": USER}
    assert (
        messages.parse({**body, "thinking": {"type": "enabled", "budget_tokens": 2000}})[
            0
        ].reasoning
        is True
    )
    assert messages.parse({**body, "thinking": {"type": "disabled"}})[0].reasoning is False


def test_max_tokens_always_reach_the_model():
    assert chat.parse({"model": "m", "messages": USER, "max_tokens": 7})[0].max_tokens == 7
    assert (
        chat.parse({"model": "m", "messages": USER, "max_completion_tokens": 9})[0].max_tokens == 9
    )
    assert wire.parse({"model": "m", "input": "x", "max_output_tokens": 11})[0].max_tokens == 11
    assert messages.parse({"model": "m", "messages": USER, "max_tokens": 13})[0].max_tokens == 13


def test_responses_penalties_reach_the_model():
    body = {"model": "m", "input": "x", "presence_penalty": 0.5, "frequency_penalty": -1}
    request, _ = wire.parse(body)
    assert (request.presence_penalty, request.frequency_penalty) == (0.5, -1.0)
    request, _ = wire.parse({"model": "m", "input": "x"})
    assert (request.presence_penalty, request.frequency_penalty) == (None, None)


def test_responses_accepts_the_specs_response_shaping_fields():
    """Fields that only shape the response object are accepted (and echoed there)."""
    body = {
        "model": "m",
        "input": "x",
        "store": False,
        "background": False,
        "service_tier": "priority",
        "safety_identifier": "u1",
        "prompt_cache_key": "s1",
        "max_tool_calls": 2,
        "top_logprobs": 20,
        "parallel_tool_calls": False,
        "truncation": "auto",
        "text": {"format": {"type": "text"}, "verbosity": "high"},
        "include": ["reasoning.encrypted_content", "message.output_text.logprobs"],
        "stream_options": {"include_obfuscation": True},
        "reasoning": {"effort": "low", "summary": "auto"},
        "metadata": {f"k{i}": "v" * 512 for i in range(16)},
    }
    request, parsed = wire.parse(body)
    assert parsed.store is False and parsed.max_tool_calls == 2
    assert request.session_key == "s1" and len(request.metadata) == 16


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"text": {"format": {"type": "json_schema", "name": "a", "schema": {"not": {}}}}},
            "text.format.schema.not",
        ),
        ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"text": {"verbosity": "loud"}}, "text.verbosity"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"max_tool_calls": 0}, "max_tool_calls"),
        ({"service_tier": "turbo"}, "service_tier"),
        ({"truncation": "sometimes"}, "truncation"),
        ({"store": 3}, "store"),
        ({"background": "maybe"}, "background"),
        ({"parallel_tool_calls": []}, "parallel_tool_calls"),
        ({"safety_identifier": "x" * 65}, "safety_identifier"),
        ({"prompt_cache_key": "x" * 65}, "prompt_cache_key"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
        ({"include": "reasoning.encrypted_content"}, "include"),
        ({"stream_options": {"include_obfuscation": "x"}}, "stream_options.include_obfuscation"),
        ({"reasoning": {"summary": "long"}}, "reasoning.summary"),
        ({"presence_penalty": "a"}, "presence_penalty"),
    ],
)
def test_responses_bad_fields_are_400_naming_them(extra, param):
    with pytest.raises(RequestInvalid) as info:
        wire.parse({"model": "m", "input": "x", **extra})
    assert info.value.param == param and info.value.message.startswith(param + ": ")


def test_chat_tools_and_tool_turns():
    body = {
        "model": "m",
        "messages": [
            {"role": "developer", "content": "sys"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "think",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": {"x": 1}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "stop": "END",
        "stream_options": {"include_usage": True},
    }
    request, _ = chat.parse(body)
    assert [m.role for m in request.messages] == ["system", "user", "assistant", "tool"]
    assert request.messages[1].content == "ab"
    assert request.messages[2].tool_calls[0].arguments == '{"x":1}'
    assert request.messages[2].reasoning == "think"
    assert request.tools[0].parameters == {"type": "object", "properties": {}}
    assert request.stop == ["END"]


def test_anthropic_blocks_become_turns_in_order():
    body = {
        "model": "m",
        "max_tokens": 5,
        "system": [{"type": "text", "text": "S"}],
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "x"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "res"}],
                    },
                    {"type": "text", "text": "more"},
                ],
            },
        ],
        "tool_choice": {"type": "any"},
        "stop_sequences": ["###"],
    }
    request, _ = messages.parse(body)
    assert [m.role for m in request.messages] == ["system", "user", "assistant", "tool", "user"]
    assistant = request.messages[2]
    assert (assistant.reasoning, assistant.content) == ("hm", "calling")
    assert assistant.tool_calls[0].arguments == '{"a":1}'
    assert request.messages[3].tool_call_id == "t1" and request.messages[3].content == "res"
    assert request.tool_choice == "required" and request.stop == ["###"]


@pytest.mark.parametrize(
    ("api", "body", "names"),
    [
        (chat, {"model": "m", "messages": []}, "messages"),
        (chat, {"model": "m", "messages": USER, "n": 17}, "^n: "),
        (
            chat,
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "image_url",
        ),
        (
            wire,
            {"model": "m", "input": "x", "previous_response_id": 7},
            "previous_response_id",
        ),
        (wire, {"model": "m", "input": "x", "tools": [{"type": "teleport"}]}, "tools.0.type"),
        (messages, {"model": "m", "max_tokens": 0, "messages": USER}, "max_tokens"),
        (
            messages,
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "image"}]}],
            },
            "image",
        ),
    ],
)
def test_bad_bodies_name_the_problem(api, body, names):
    with pytest.raises(RequestInvalid, match=names):
        api.parse(body)


def test_system_placement_keeps_leading_and_folds_later_ones():
    turns = [
        Message(role="system", content="S"),
        Message(role="user", content="u1"),
        Message(role="assistant", content="a1"),
        Message(role="system", content="R1"),
        Message(role="user", content="u2"),
        Message(role="tool", content="t", tool_call_id="c"),
        Message(role="system", content="R2"),
    ]
    placed = place_system_messages(turns)
    assert [m.role for m in placed] == ["system", "user", "assistant", "user", "tool"]
    assert placed[1].content == "u1"  # never moved back across the assistant turn
    assert placed[3].content == "R1\n\nu2"  # the next user turn
    assert placed[4].content == "t\n\nR2"  # the tool result right before it
    orphan = place_system_messages(
        [Message(role="assistant", content="a"), Message(role="system", content="R")]
    )
    assert [m.role for m in orphan] == ["assistant", "user"] and orphan[1].content == "R"


def test_system_placement_is_prefix_stable_and_loses_nothing():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    roles = st.sampled_from(["system", "user", "assistant", "tool"])
    turns = st.lists(st.tuples(roles, st.text(alphabet="abc", min_size=1, max_size=3)), max_size=10)

    @settings(max_examples=200, deadline=None)
    @given(turns, turns)
    def check(head, tail):
        def messages(pairs):
            return [Message(role=r, content=f"{r}:{c}") for r, c in pairs]

        placed = place_system_messages(messages(head))
        extended = place_system_messages(messages(head + tail))
        # Caching: what was sent before is still the start of what is sent now (but the last turn).
        assert extended[: max(len(placed) - 1, 0)] == placed[:-1]
        # Only leading system turns stay system turns; every content survives, in order.
        first_other = next((i for i, m in enumerate(placed) if m.role != "system"), len(placed))
        assert all(m.role != "system" for m in placed[first_other:])
        joined = "\n\n".join(m.content for m in placed)
        position = 0
        for m in messages(head):
            position = joined.index(m.content, position)

    check()


def test_anthropic_system_blocks_join_by_a_blank_line_without_client_metadata():
    """Claude Code's billing header changes every session: kept out of the prompt, a new
    session's prompt starts with the same tokens as the last one's (the prompt cache hits)."""

    def system_of(header: str) -> str:
        body = {
            "model": "m",
            "max_tokens": 5,
            "messages": USER,
            "system": [
                {"type": "text", "text": header},
                {"type": "text", "text": "You are Claude Code."},
                {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
            ],
        }
        request, _ = messages.parse(body)
        assert request.messages[0].role == "system"
        return request.messages[0].content

    one = system_of("x-anthropic-billing-header: cc_version=2.1.3.a1b; cc_entrypoint=cli;")
    two = system_of("x-anthropic-billing-header: cc_version=2.1.3.f9e; cc_entrypoint=sdk-cli;")
    assert one == two == "You are Claude Code.\n\nBe brief."


def test_tool_call_arguments_nested_past_what_json_writers_take_are_a_400() -> None:
    """Found by the fuzz test: ``orjson`` refuses nesting past 255 levels (a TypeError), which
    was a 500."""
    deep: dict = {}
    for _ in range(300):
        deep = {"a": deep}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    body = {"model": "m", "messages": [{"role": "assistant", "tool_calls": [call]}, *USER]}
    with pytest.raises(RequestInvalid, match=r"messages\.0\.tool_calls\.0\.function\.arguments"):
        chat.parse(body)
