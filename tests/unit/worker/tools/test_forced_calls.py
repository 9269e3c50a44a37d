"""Forced tool calls: which tools ``tool_choice`` forces, and the grammar that spells one call.

The grammars are run here against a byte-level tokenizer: a random walk through what the grammar
allows (a model with random weights, at the byte level) must always end in text that the
splitter parses into one call to an allowed tool, with arguments valid against its schema.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import llguidance
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tool_parsers import json_tools, mistral, pythonic

from worker.structured.json_grammar import validator_tokenizer
from worker.tools.forced import (
    CallSyntax,
    ToolChoiceError,
    call_grammar,
    call_syntax,
    forced_names,
)
from worker.tools.parsing import ParsedToolCall, ToolCallSplitter, parse_json_span

WORD = {"type": "string", "maxLength": 8}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": WORD, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CALC = {
    "type": "function",
    "function": {
        "name": "calculate",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -99, "maximum": 99},
                "op": {"enum": ["+", "-", "*", "/"]},
                "b": {"$ref": "#/$defs/small"},
            },
            "required": ["a", "op", "b"],
            "additionalProperties": False,
            "$defs": {"small": {"type": "integer", "minimum": 0, "maximum": 9}},
        },
    },
}
TOOLS: list[dict[str, Any]] = [WEATHER, CALC]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
GENERIC = CallSyntax("json", "<tool_call>", "</tool_call>", parse_json_span)
MISTRAL = CallSyntax("mistral", "[TOOL_CALLS]", "", mistral.parse_tool_call)


def _matcher(grammar: str | None) -> llguidance.LLMatcher:
    assert grammar is not None
    matcher = llguidance.LLMatcher(validator_tokenizer(), grammar)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def _accepts(grammar: str | None, text: str) -> bool:
    matcher = _matcher(grammar)
    data = list(text.encode())
    return matcher.try_consume_tokens(data) == len(data) and matcher.is_accepting()


def _random_walk(grammar: str | None, seed: int) -> str:
    """Bytes drawn uniformly from what the grammar allows next, until it allows only the end."""
    matcher, rng, out = _matcher(grammar), np.random.default_rng(seed), bytearray()
    for _ in range(4000):
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[:257])
        token = int(rng.choice(allowed))
        if token == 256:  # the end token
            return out.decode()
        assert matcher.consume_token(token)
        out.append(token)
    raise AssertionError(f"the grammar never ended: {out[:200]!r}")


def _calls(syntax: CallSyntax, text: str) -> list[Any]:
    splitter = ToolCallSplitter(start=syntax.start, end=syntax.end, parser=syntax.parser)
    pieces = splitter.feed(text) + splitter.finish()
    return [value for kind, value in pieces if kind in ("tool_call", "tool_call_end")]


def test_auto_none_and_absent_force_nothing() -> None:
    for choice in (None, "auto", "none"):
        assert forced_names(choice, TOOLS) is None


def test_required_forces_any_offered_tool_and_a_name_forces_that_one() -> None:
    assert forced_names("required", TOOLS) == ("get_weather", "calculate")
    named = {"type": "function", "function": {"name": "calculate"}}
    assert forced_names(named, TOOLS) == ("calculate",)
    assert forced_names({"type": "function", "name": "calculate"}, TOOLS) == ("calculate",)


@pytest.mark.parametrize(
    ("choice", "tools"),
    [
        ("required", None),
        ({"type": "function", "function": {"name": "nope"}}, TOOLS),
        ({"type": "function"}, TOOLS),
        ("any", TOOLS),
        ({"type": "tool", "name": "get_weather"}, TOOLS),
    ],
)
def test_impossible_or_malformed_choices_are_the_clients_mistake(choice: Any, tools: Any) -> None:
    with pytest.raises(ToolChoiceError):
        forced_names(choice, tools)


def test_the_generic_grammar_takes_exactly_a_call_to_an_allowed_tool() -> None:
    grammar = call_grammar(GENERIC, TOOLS, ("get_weather", "calculate"))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    assert _accepts(grammar, call + "</tool_call>")
    assert not _accepts(grammar, "It is sunny in Paris.")
    assert not _accepts(grammar, call.replace("get_weather", "get_time") + "</tool_call>")
    assert not _accepts(grammar, call.replace('"c"', '"k"') + "</tool_call>")  # not in the enum
    assert not _accepts(grammar, call)  # the end marker is part of it
    only = call_grammar(GENERIC, TOOLS, ("calculate",))
    assert not _accepts(only, call + "</tool_call>")
    assert _accepts(
        only, '<tool_call>\n{"name": "calculate", "arguments": {"a": 2, "op": "+", "b": 3}}\n'
        "</tool_call>"
    )  # fmt: skip


@settings(deadline=None, max_examples=30)  # a walk is ~1000 grammar steps: no timing here
@given(seed=st.integers(0, 2**32 - 1))
def test_any_walk_through_the_grammar_is_a_parsable_valid_call(seed: int) -> None:
    names = ("get_weather", "calculate")
    for syntax in (GENERIC, MISTRAL):
        text = _random_walk(call_grammar(syntax, TOOLS, names), seed)
        (call,) = _calls(syntax, text)
        assert isinstance(call, ParsedToolCall) and call.name in names
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_mistral_calls_run_to_the_end_of_the_answer() -> None:
    grammar = call_grammar(MISTRAL, TOOLS, ("calculate",))
    assert _accepts(grammar, '[TOOL_CALLS]calculate[ARGS]{"a": 1, "op": "*", "b": 2}')
    assert not _accepts(grammar, '[TOOL_CALLS]calculate[ARGS]{"a": 1, "op": "*", "b": 2} ok')


def test_a_marker_that_is_a_special_token_is_spelled_as_that_token() -> None:
    grammar = call_grammar(GENERIC, TOOLS, ("calculate",), {"<tool_call>": 7}.get)
    assert grammar is not None and '"<[7]>' not in grammar and "<[7]>" in grammar
    assert '"<tool_call>"' not in grammar and '"</tool_call>"' in grammar


def test_syntaxes_that_are_not_json_have_no_grammar() -> None:
    other = CallSyntax("other", "<|tool_call_start|>", "<|tool_call_end|>", parse_json_span)
    assert call_grammar(other, TOOLS, ("calculate",)) is None


def test_a_schema_llguidance_cannot_hold_strictly_still_forces_the_call() -> None:
    loose = {
        "type": "function",
        "function": {
            "name": "tag",
            "parameters": {
                "type": "object",
                "properties": {"ids": {"type": "array", "items": WORD, "uniqueItems": True}},
                "required": ["ids"],
            },
        },
    }
    broken = {"type": "function", "function": {"name": "odd", "parameters": "not a schema"}}
    grammar = call_grammar(GENERIC, [loose, broken], ("tag", "odd"))
    assert _accepts(grammar, '<tool_call>\n{"name": "tag", "arguments": {"ids": ["a"]}}\n</tool_call>')  # fmt: skip
    assert _accepts(grammar, '<tool_call>\n{"name": "odd", "arguments": {}}\n</tool_call>')


class _Tokenizer:
    def __init__(self, parser: Any) -> None:
        self.has_tool_calling = parser is not None
        self.tool_parser = parser
        self.tool_call_start = "[TOOL_CALLS]"
        self.tool_call_end = ""


def test_the_syntax_is_the_one_the_splitter_parses() -> None:
    assert call_syntax(_Tokenizer(None)).kind == "json"
    assert call_syntax(_Tokenizer(None)).start == "<tool_call>"
    assert call_syntax(_Tokenizer(json_tools.parse_tool_call)).kind == "json"
    syntax = call_syntax(_Tokenizer(mistral.parse_tool_call))
    assert (syntax.kind, syntax.start, syntax.end) == ("mistral", "[TOOL_CALLS]", "")
    assert call_syntax(_Tokenizer(pythonic.parse_tool_call)).kind == "other"
