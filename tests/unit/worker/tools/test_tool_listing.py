"""Tool listings shortened to fit the context (worker.tools.listing, worker.tools.prompt)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from worker.tools import listing as tool_listing
from worker.tools.listing import first_sentence, listed, reserve, top_level
from worker.tools.prompt import tools_section

BASH = {
    "type": "function",
    "function": {
        "name": "Bash",
        "description": "Executes a bash command and returns its output.\n\nThe working "
        "directory persists between commands. " + "Long manual text. " * 50,
        "parameters": {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The command to execute"},
                # A parameter may be named like an annotation: it must survive.
                "description": {"type": "string", "description": "What the command does"},
                "timeout": {"type": "number", "description": "Timeout in ms", "default": 120},
                "mode": {"enum": [{"description": "data, not an annotation"}, "b"]},
                "env": {"anyOf": [{"type": "object"}, {"type": "null"}]},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
    },
}


def test_brief_keeps_every_name_and_type_and_drops_the_prose():
    (brief,) = listed([BASH], "brief")
    function = brief["function"]
    assert function["description"] == "Executes a bash command and returns its output."
    schema = function["parameters"]
    assert list(schema["properties"]) == ["command", "description", "timeout", "mode", "env"]
    assert schema["properties"]["command"] == {"type": "string"}
    assert schema["properties"]["description"] == {"type": "string"}
    assert schema["properties"]["timeout"] == {"type": "number"}
    assert schema["properties"]["mode"]["enum"][0] == {"description": "data, not an annotation"}
    assert schema["required"] == ["command"] and schema["additionalProperties"] is False
    assert "$schema" not in schema
    assert BASH["function"]["parameters"]["properties"]["command"]["description"]  # not mutated


def test_names_is_one_signature_line_per_tool():
    section = tools_section([BASH], "names")
    assert (
        "Bash(command: string, description?: string, timeout?: number, mode?: enum, "
        "env?: object|null): Executes a bash command and returns its output." in section
    )
    assert "name(parameter: type, optional?: type)" in section
    full = tools_section([BASH])
    assert "JSON Schema" in full and "Long manual text." in full
    assert "Long manual text." not in tools_section([BASH], "brief")


def test_top_level_of_a_schema_without_properties():
    assert top_level({"type": "object"}) == {"type": "object", "properties": {}}
    assert top_level({"properties": {"a": {}}, "required": ["a", "gone"]}) == {
        "type": "object",
        "properties": {"a": {"type": "any"}},
        "required": ["a"],
    }


def test_first_sentence_is_bounded():
    assert first_sentence("One. Two.") == "One."
    assert first_sentence("  no full stop\nat all  ") == "no full stop at all"
    assert first_sentence("v1.2 is out. Then") == "v1.2 is out."
    long = first_sentence("word " * 100)
    assert len(long) == 200 and long.endswith("…")


def _fit(sizes: dict[str, int], context: int) -> str:
    rendered = []

    def render(listing: str) -> str:
        rendered.append(listing)
        return listing

    _, listing = tool_listing.fit(render, sizes.__getitem__, context)
    assert rendered == list(tool_listing.LISTINGS[: len(rendered)])  # most detailed first
    return listing


def test_fit_takes_the_most_detailed_listing_that_leaves_the_reserve():
    assert reserve(8192) == 2048 and reserve(1_000_000) == tool_listing.MAX_RESERVE
    sizes = {"full": 22_000, "brief": 6_800, "names": 4_300}  # Claude Code's 25 tools, SmolLM2
    assert _fit(sizes, 8192) == "names"
    assert _fit(sizes, 10_000) == "brief"
    assert _fit(sizes, 32_768) == "full"
    assert _fit({"full": 9_000, "brief": 9_000, "names": 9_000}, 8192) == "names"  # the smallest


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.sampled_from(["type", "description", "properties", "x",
                                                       "enum", "title", "items"]), inner,
                                      max_size=4), max_leaves=12))  # fmt: skip
def test_any_parameters_shorten_without_error(parameters):
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    for listing in tool_listing.LISTINGS:
        json.dumps(listed([tool], listing))
        tools_section([tool], listing)
