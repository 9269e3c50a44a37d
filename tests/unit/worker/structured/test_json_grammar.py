"""JSON schema → llguidance grammar: what compiles, what is refused and where the error points."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.structured.json_grammar import SchemaError, json_grammar, locate

STRING = {"type": "string", "maxLength": 8}
SUPPORTED: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {
            "name": STRING,
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "color": {"enum": ["red", "green"]},
            "tags": {"type": "array", "items": STRING, "maxItems": 3},
        },
        "required": ["name", "age", "color", "tags"],
        "additionalProperties": False,
    },
    "refs": {
        "$defs": {"p": {"type": "object", "properties": {"x": {"type": "number"}}}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/p"}},
    },
    "recursive": {
        "$defs": {"n": {"type": "object", "properties": {"k": {"$ref": "#/$defs/n"}}}},
        "$ref": "#/$defs/n",
    },
    "unions": {"anyOf": [{"type": "string"}, {"type": ["integer", "null"]}]},
    "one_of": {"oneOf": [{"const": "a"}, {"const": "b"}]},
    "all_of": {"allOf": [{"type": "object"}, {"required": ["a"]}]},
    "pattern_format": {
        "type": "object",
        "properties": {
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "at": {"type": "string", "format": "date-time"},
        },
    },
    "annotations": {
        "title": "T",
        "description": "d",
        "$schema": "http://json-schema.org/draft-07/schema#",
        "examples": [{}],
    },
    "prefix_items": {"type": "array", "prefixItems": [{"type": "integer"}], "items": False},
}


@pytest.mark.parametrize("schema", SUPPORTED.values(), ids=SUPPORTED.keys())
def test_supported_schemas_compile(schema: dict[str, Any]) -> None:
    assert json_grammar(schema)


def test_no_schema_is_any_json_object() -> None:
    assert json_grammar(None) == json_grammar({"type": "object"})


@pytest.mark.parametrize(
    ("schema", "path", "says"),
    [
        ({"type": "array", "uniqueItems": True}, ("uniqueItems",), "uniqueItems"),
        (
            {"properties": {"not": {"type": "string"}, "b": {"items": {"if": {}}}}},
            ("properties", "b", "items", "if"),  # the property named "not" is not the keyword
            "if",
        ),
        ({"properties": {"a": {"type": "strin"}}}, ("properties", "a", "type"), "strin"),
        ({"properties": {"a": {"$ref": "#/$defs/x"}}}, ("properties", "a", "$ref"), "/$defs/x"),
        ({"properties": {"a": {"format": "planet"}}}, ("properties", "a", "format"), "planet"),
        ({"properties": {"z": {"pattern": "(?<=a)b"}}}, ("properties", "z", "pattern"), "look"),
        (
            {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
                "required": ["n"],
            },
            ("properties", "n"),
            "unsatisfiable",
        ),
        (
            {"anyOf": [{"type": "string"}, {"dependentSchemas": {}}]},
            ("anyOf", "1", "dependentSchemas"),
            "dependentSchemas",
        ),
        # a schema cannot switch the check off with its own llguidance options
        ({"x-guidance": {"lenient": True}, "not": {}}, ("not",), "not"),
    ],
)
def test_unsupported_or_unsatisfiable_is_refused_naming_where(
    schema: dict[str, Any], path: tuple[str, ...], says: str
) -> None:
    with pytest.raises(SchemaError) as info:
        json_grammar(schema)
    assert info.value.path == path
    assert says in info.value.message and "\n" not in info.value.message
    assert info.value.param("text.format.schema") == ".".join(("text.format.schema", *path))


def test_a_message_it_cannot_place_names_the_schema() -> None:
    assert locate({"type": "object"}, "something else went wrong") == ()


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(["string", "object", "x"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "type",
                    "properties",
                    "items",
                    "not",
                    "if",
                    "enum",
                    "required",
                    "a",
                    "$ref",
                    "format",
                ]
            ),
            inner,
            max_size=3,
        )
    ),
    max_leaves=12,
)


def _at(value: Any, path: tuple[str, ...]) -> Any:
    for step in path:
        value = value[int(step)] if isinstance(value, list) else value[step]
    return value


@settings(max_examples=150)
@given(schema=st.dictionaries(st.sampled_from(["type", "properties", "items", "not"]), _JSON))
def test_any_schema_compiles_or_is_refused_at_a_real_place(schema: dict[str, Any]) -> None:
    try:
        json_grammar(schema)
    except SchemaError as exc:
        _at(schema, exc.path)  # the path exists in the schema


def test_a_schema_nested_past_the_recursion_limit_is_refused_not_a_crash() -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(2000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(SchemaError, match=r"(?i)recursion"):
        json_grammar(schema)


def test_the_same_schema_again_is_not_compiled_again() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert json_grammar(schema) is json_grammar(dict(schema))


def test_a_panic_in_the_grammar_library_is_a_schema_error() -> None:
    """llguidance 1.9.1 panics (a BaseException from Rust) cutting an error message inside a
    multi-byte character; found by fuzzing. It must be a 400, not a crash of the request."""
    schema = {
        "minLength": {
            "minimum": [{}, [2117064849245], {"$ref": None}, {}],
            "maximum": {"maximum": 518936},
            "maxProperties": "\U00052f13±Ù\U0002e549>",
            "items": {"maximum": 518936},
        }
    }
    with pytest.raises(SchemaError) as info:
        json_grammar(schema)
    assert "\n" not in info.value.message
