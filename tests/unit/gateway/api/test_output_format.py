"""Structured output in the three client APIs: parsed into ``OutputFormat``, sent to the worker as
``response_format``, echoed by Responses, and refused with a 400 naming the field."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from openresponses import check_response

from gateway.answer import Accumulator
from gateway.api import chat, messages
from gateway.events import Done, TextDelta
from gateway.refusals import RequestInvalid
from gateway.request import OutputFormat
from gateway.responses import wire
from gateway.worker_client import worker_body

SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 40}},
    "required": ["title"],
    "additionalProperties": False,
}
UNIQUE = {"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "m", "input": "hi"}
MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def _chat(response_format: dict[str, Any]) -> OutputFormat | None:
    return chat.parse({**CHAT, "response_format": response_format})[0].output_format


def _responses(text_format: dict[str, Any]) -> OutputFormat | None:
    return wire.parse({**RESPONSES, "text": {"format": text_format}})[0].output_format


def test_chat_response_format() -> None:
    spec = {"name": "title", "schema": SCHEMA, "strict": True}
    assert _chat({"type": "json_schema", "json_schema": spec}) == OutputFormat(
        json_schema=SCHEMA, name="title", strict=True
    )
    assert _chat({"type": "json_object"}) == OutputFormat()
    assert _chat({"type": "text"}) is None
    assert chat.parse(CHAT)[0].output_format is None


def test_responses_text_format() -> None:
    given = {"type": "json_schema", "name": "t", "schema": SCHEMA, "description": "a title"}
    assert _responses(given) == OutputFormat(json_schema=SCHEMA, name="t", description="a title")
    assert _responses({"type": "json_object"}) == OutputFormat()
    assert _responses({"type": "text"}) is None


def test_messages_output_config_and_the_betas_output_format() -> None:
    fmt = {"type": "json_schema", "schema": SCHEMA}
    for extra in ({"output_config": {"format": fmt, "effort": "low"}}, {"output_format": fmt}):
        request, _ = messages.parse({**MESSAGES, **extra})
        assert request.output_format == OutputFormat(json_schema=SCHEMA)
    assert messages.parse({**MESSAGES, "output_config": {"effort": "low"}})[0].output_format is None


@pytest.mark.parametrize(
    ("effort", "reasoning_effort"),
    [("low", "low"), ("high", "high"), ("xhigh", "xhigh"), ("max", "xhigh"), (None, None)],
)
def test_messages_effort_is_the_reasoning_effort_templates_read(effort, reasoning_effort) -> None:
    """Claude Code sends ``output_config.effort`` (high); the worker passes reasoning_effort
    to the chat template, so a model that reads it (gpt-oss) follows the client's effort."""
    request, _ = messages.parse({**MESSAGES, "output_config": {"effort": effort}})
    assert request.reasoning_effort == reasoning_effort
    assert worker_body(request, "m").get("reasoning_effort") == reasoning_effort


@pytest.mark.parametrize(
    ("parse", "body", "param"),
    [
        (
            chat.parse,
            {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": UNIQUE}}},
            "response_format.json_schema.schema.properties.ids.uniqueItems",
        ),
        (chat.parse, {**CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
        (chat.parse, {**CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
        (
            wire.parse,
            {
                **RESPONSES,
                "text": {"format": {"type": "json_schema", "name": "n", "schema": UNIQUE}},
            },
            "text.format.schema.properties.ids.uniqueItems",
        ),
        (
            wire.parse,
            {**RESPONSES, "text": {"format": {"type": "json_schema", "name": "n"}}},
            "text.format.schema",
        ),
        (
            messages.parse,
            {**MESSAGES, "output_config": {"format": {"type": "json_schema", "schema": UNIQUE}}},
            "output_config.format.schema.properties.ids.uniqueItems",
        ),
        (
            messages.parse,
            {**MESSAGES, "output_config": {"format": {"type": "json_schema"}}},
            "output_config.format.schema",
        ),
        (messages.parse, {**MESSAGES, "output_config": {"effort": "huge"}}, "output_config.effort"),
        (
            messages.parse,
            {**MESSAGES, "output_format": {"type": "json_schema", "schema": {"not": {}}}},
            "output_format.schema.not",
        ),
    ],
)
def test_what_cannot_be_held_is_400_naming_the_field(
    parse: Any, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(RequestInvalid) as info:
        parse(body)
    assert info.value.param == param and info.value.message.startswith(param + ": ")


def test_the_worker_gets_a_chat_response_format() -> None:
    request, _ = wire.parse(
        {**RESPONSES, "text": {"format": {"type": "json_schema", "name": "t", "schema": SCHEMA}}}
    )
    assert worker_body(request, "w")["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "t", "schema": SCHEMA},
    }
    request, _ = messages.parse(
        {**MESSAGES, "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}
    )
    assert worker_body(request, "w")["response_format"]["json_schema"]["name"] == "response"
    request, _ = chat.parse({**CHAT, "response_format": {"type": "json_object"}})
    assert worker_body(request, "w")["response_format"] == {"type": "json_object"}
    assert "response_format" not in worker_body(chat.parse(CHAT)[0], "w")


def _response_object(text_format: dict[str, Any]) -> dict[str, Any]:
    request, parsed = wire.parse({**RESPONSES, "text": {"format": text_format}})
    acc = Accumulator()
    for event in (TextDelta('{"title": "x"}'), Done()):
        acc.add(event)
    return wire.response_body(request, parsed, acc)


def test_responses_echo_the_format_they_were_asked_for() -> None:
    json_object = _response_object({"type": "json_object"})
    assert json_object["text"]["format"] == {"type": "json_object"}
    check_response(json_object)
    body = _response_object({"type": "json_schema", "name": "t", "schema": SCHEMA, "strict": True})
    assert body["text"]["format"] == {
        "type": "json_schema",
        "name": "t",
        "description": None,
        "schema": SCHEMA,
        "strict": True,
    }
    # A deliberate departure: the Open Responses document types the echoed schema as null, the
    # openai SDK (openai.types.responses.ResponseFormatTextJSONSchemaConfig) requires the object.
    as_the_spec_has_it = copy.deepcopy(body)
    as_the_spec_has_it["text"]["format"]["schema"] = None
    check_response(as_the_spec_has_it)
