"""The tools of a Responses request: every OpenAI tool type accepted, namespaced and custom tools
shown to the model as functions and their calls mapped back, hosted tools left out and named,
malformed tools refused with a 400 naming them; Codex CLI's real requests parse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.refusals import RequestInvalid
from gateway.responses import wire
from gateway.responses.tools import (
    HOSTED_TYPES,
    ServedTool,
    custom_arguments,
    custom_input,
    flat_name,
    ignored_header,
    parse_tools,
)

CODEX = json.loads((Path(__file__).parents[3] / "fixtures" / "codex_requests.json").read_text())
PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'},
}
GROUP = {
    "type": "namespace",
    "name": "crm",
    "description": "Customer records.",
    "tools": [
        {"type": "function", "name": "lookup", "parameters": {"type": "object"}},
        {"type": "custom", "name": "note"},
    ],
}


def test_functions_are_shown_as_they_are():
    tools = parse_tools([{"type": "function", "name": "f", "description": "d", "strict": True}])
    assert [(s.name, s.description) for s in tools.specs] == [("f", "d")]
    assert tools.specs[0].parameters == {"type": "object", "properties": {}}
    assert tools.served == {} and tools.ignored == []
    assert tools.echo == [
        {"type": "function", "name": "f", "description": "d", "parameters": None, "strict": True}
    ]


def test_namespace_tools_are_shown_flat_and_map_back():
    tools = parse_tools([GROUP])
    assert [s.name for s in tools.specs] == ["crm__lookup", "crm__note"]
    assert tools.served == {
        "crm__lookup": ServedTool(name="lookup", namespace="crm"),
        "crm__note": ServedTool(name="note", namespace="crm", custom=True),
    }
    assert [t["name"] for t in tools.echo] == ["crm__lookup", "crm__note"]


def test_custom_tools_take_one_string_and_carry_their_grammar():
    tools = parse_tools([PATCH])
    spec = tools.specs[0]
    assert spec.name == "apply_patch" and tools.served["apply_patch"].custom
    assert spec.parameters["required"] == ["input"]
    assert spec.parameters["properties"]["input"]["type"] == "string"
    assert spec.description.startswith("Edit files.") and "lark" in spec.description
    assert '"*** Begin Patch"' in spec.description


@pytest.mark.parametrize("kind", sorted(HOSTED_TYPES))
def test_hosted_tools_are_left_out_and_named(kind):
    tools = parse_tools([{"type": "function", "name": "f"}, {"type": kind}, {"type": kind}])
    assert [s.name for s in tools.specs] == ["f"] and len(tools.echo) == 1
    assert tools.ignored == [kind]
    assert ignored_header(tools) == {"x-tools-ignored": kind}


def test_no_header_when_nothing_is_left_out():
    assert ignored_header(parse_tools([{"type": "function", "name": "f"}])) == {}


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        ({"type": "function"}, "tools.0.name"),
        ({"type": "function", "name": ""}, "tools.0.name"),
        ({"type": "function", "name": "f", "parameters": "s"}, "tools.0.parameters"),
        ({"type": "custom"}, "tools.0.name"),
        ({"type": "custom", "name": "c", "format": {"type": "yaml"}}, "tools.0.format.type"),
        ({"type": "namespace", "name": "n", "description": "d"}, "tools.0.tools"),
        ({"type": "namespace", "name": "n", "tools": [{"type": "mcp"}]}, "tools.0.tools.0.type"),
        (
            {"type": "namespace", "name": "n", "tools": [{"type": "function"}]},
            "tools.0.tools.0.name",
        ),
        ({"type": "teleport"}, "tools.0.type"),
        ({"name": "f"}, "tools.0.type"),
        ("f", "tools.0.type"),
    ],
)
def test_malformed_tools_are_400s_naming_them(tool, param):
    with pytest.raises(RequestInvalid) as info:
        wire.parse({"model": "m", "input": "x", "tools": [tool]})
    assert info.value.param == param and info.value.message.startswith(param + ": ")


def test_flat_names_follow_codex():
    assert flat_name(None, "f") == "f"
    assert flat_name("mcp__server__", "_list") == "mcp__server__list"


@pytest.mark.parametrize(
    ("arguments", "text"),
    [
        (custom_arguments("*** Begin Patch\n"), "*** Begin Patch\n"),
        ('"just a string"', "just a string"),
        ("*** Begin Patch (not JSON)", "*** Begin Patch (not JSON)"),
        ('{"patch": "x"}', '{"patch": "x"}'),
    ],
)
def test_custom_input_from_what_the_model_wrote(arguments, text):
    assert custom_input(arguments) == text


@pytest.mark.parametrize("turn", ["first", "tool_output", "gpt-5.5"])
def test_codex_requests_parse(turn):
    request, body = wire.parse(CODEX[turn])
    names = {spec.name for spec in request.tools}
    assert "exec_command" in names
    assert body.store is False and body.encrypted_reasoning
    assert "web_search" in body._tools.ignored
    if turn == "gpt-5.5":
        assert body._tools.served["apply_patch"].custom
        assert body._tools.ignored == ["tool_search", "web_search"]
    else:
        assert "multi_agent_v1__close_agent" in names
        assert body._tools.ignored == ["web_search"]


def test_a_tool_type_that_is_not_a_string_is_a_400_naming_it():
    with pytest.raises(RequestInvalid) as caught:
        parse_tools([{"type": ["function"], "name": "f"}])
    assert caught.value.param == "tools.0.type"
