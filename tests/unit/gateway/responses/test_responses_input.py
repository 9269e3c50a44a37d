"""Responses input as a stateless client (Codex CLI: ``store: false``) hands it back: encoded
reasoning, namespaced and custom tool calls and their outputs, ``include`` values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.answer import Accumulator
from gateway.events import Done, ReasoningDelta, TextDelta
from gateway.refusals import RequestInvalid
from gateway.responses import wire
from gateway.responses.compacted import decode_reasoning, encode_history, encode_reasoning

CODEX = json.loads((Path(__file__).parents[3] / "fixtures" / "codex_requests.json").read_text())
USER = {"role": "user", "content": "hi"}


def _messages(*items):
    return wire.parse({"model": "m", "input": [USER, *items]})[0].messages


def test_include_takes_the_specs_values_only():
    both = ["reasoning.encrypted_content", "message.output_text.logprobs"]
    assert wire.parse({"model": "m", "input": "x", "include": both})[1].encrypted_reasoning
    assert not wire.parse({"model": "m", "input": "x"})[1].encrypted_reasoning
    with pytest.raises(RequestInvalid) as info:
        wire.parse({"model": "m", "input": "x", "include": [both[0], "file_search_call"]})
    assert info.value.param == "include.1" and info.value.message.startswith("include.1: ")


def test_reasoning_round_trips_through_encrypted_content():
    body = {"model": "m", "input": "x", "include": ["reasoning.encrypted_content"]}
    request, parsed = wire.parse(body)
    acc = Accumulator()
    for event in (ReasoningDelta("first "), ReasoningDelta("think"), TextDelta("4"), Done()):
        acc.add(event)
    reasoning = wire.response_body(request, parsed, acc)["output"][0]
    assert reasoning["encrypted_content"].startswith("mlxmesh-reasoning-v1.")
    assert decode_reasoning(reasoning["encrypted_content"]) == "first think"
    # Handed back as Codex does: no readable content, only the encoded text.
    handed_back = {
        "type": "reasoning",
        "summary": [],
        "encrypted_content": reasoning["encrypted_content"],
    }
    messages = _messages(handed_back, {"role": "assistant", "content": "4"})
    assert (messages[-1].role, messages[-1].reasoning) == ("assistant", "first think")


def test_without_include_reasoning_is_not_encoded():
    request, parsed = wire.parse({"model": "m", "input": "x"})
    acc = Accumulator()
    for event in (ReasoningDelta("hm"), TextDelta("4"), Done()):
        acc.add(event)
    assert "encrypted_content" not in wire.response_body(request, parsed, acc)["output"][0]


@pytest.mark.parametrize(
    ("item", "reasoning"),
    [
        # readable content wins over everything
        (
            {
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": "sum"}],
                "content": [{"type": "reasoning_text", "text": "raw"}],
                "encrypted_content": encode_reasoning("encoded"),
            },
            "raw",
        ),
        # another server's encrypted content cannot be read: the summary is what is left
        (
            {
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": "sum"}],
                "encrypted_content": "gAAAAABo-opaque",
            },
            "sum",
        ),
        ({"type": "reasoning", "summary": [], "encrypted_content": "gAAAAABo-opaque"}, None),
    ],
)
def test_reasoning_read_back_prefers_what_is_readable(item, reasoning):
    assert _messages(item, {"role": "assistant", "content": "a"})[-1].reasoning == reasoning


def test_namespaced_and_custom_calls_come_back_under_the_models_names():
    messages = _messages(
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "close_agent",
            "namespace": "multi_agent_v1",
            "arguments": '{"target": "a"}',
        },
        {"type": "function_call_output", "call_id": "c1", "output": "closed"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "Success."},
    )
    assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant", "tool"]
    first, second = messages[1].tool_calls[0], messages[3].tool_calls[0]
    assert (first.name, first.arguments) == ("multi_agent_v1__close_agent", '{"target": "a"}')
    assert (second.name, json.loads(second.arguments)) == ("apply_patch", {"input": "*** Begin"})
    assert (messages[4].tool_call_id, messages[4].content) == ("c2", "Success.")


def test_codex_second_turn_reads_as_one_tool_round():
    request, _ = wire.parse(CODEX["tool_output"])
    *_, user, assistant, tool = request.messages
    assert user.role == "user" and "echo hi" in user.content
    assert assistant.reasoning == "I should run it."
    assert [(c.name, json.loads(c.arguments)) for c in assistant.tool_calls] == [
        ("exec_command", {"cmd": "echo hi"})
    ]
    assert tool.role == "tool" and tool.content.endswith("Output:\nhi\n")


def test_a_compaction_that_carries_the_history_reads_as_that_history():
    """A compact that replaced nothing answers with one item carrying the history (issue #44):
    handed back, alone or among other items, the model reads the very same turns."""
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    history = [
        USER,
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        call,
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is 42."}]},
    ]
    item = {"type": "compaction", "encrypted_content": encode_history(history)}
    after = {"role": "user", "content": "thanks"}
    expected = wire.parse({"model": "m", "input": [*history, after]})[0].messages
    assert wire.parse({"model": "m", "input": [item, after]})[0].messages == expected
    # An item inside it that is not one (edited by hand) is a 400 naming where it sits.
    broken = {"type": "compaction", "encrypted_content": encode_history([{"type": "nope"}])}
    with pytest.raises(RequestInvalid) as info:
        wire.parse({"model": "m", "input": [broken]})
    assert info.value.param == "input.0.encrypted_content.0.type"
