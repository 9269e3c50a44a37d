"""Structured output through the gateway over the real worker (tiny random-weight models, HTTP on
loopback): Chat ``response_format``, Responses ``text.format`` and Messages
``output_config.format`` give JSON that validates against the schema, also batched with other
requests; cut short it is honestly ``length``; thinking is off; unsupported schemas are 400.

Random weights say junk, so every string, number and list in these schemas is bounded: the
grammar, not the model, decides that the value ends, and it must end.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.testing import ServerThread
from gateway.upstream import ModelInfo, StaticDirectory
from gateway.worker_client import WorkerClient
from worker.engine.core import Engine
from worker.testing import run_worker_in_thread

WORD = {"type": "string", "maxLength": 10}
PERSON = {
    "type": "object",
    "properties": {
        "name": WORD,
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": WORD, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": WORD, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
EVENT = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "ok": {"type": "boolean"},
        "level": {"anyOf": [{"enum": ["low", "high"]}, {"type": "null"}]},
        "points": {
            "type": "array",
            "items": {"$ref": "#/$defs/point"},
            "maxItems": 2,
        },
    },
    "required": ["id", "ok", "level", "points"],
    "additionalProperties": False,
    "$defs": {
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["x"],
            "additionalProperties": False,
        }
    },
}
TITLE = {  # Claude Code's title request has this shape (unbounded there; a real model ends it)
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 30}},
    "required": ["title"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "event": EVENT, "title": TITLE}
UNIQUE = {"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}
USER = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def workers(tiny_model_dir: Path, tiny_think_model_dir: Path) -> Iterator[dict[str, Any]]:
    with (
        run_worker_in_thread(tiny_model_dir, name="tiny") as plain,
        run_worker_in_thread(tiny_think_model_dir, name="think") as think,
    ):
        yield {"tiny": plain, "think": think}


@pytest.fixture(scope="module")
def gateway(workers: dict[str, Any]) -> Iterator[str]:
    directory = StaticDirectory()
    for name, (url, _) in workers.items():
        directory.add(ModelInfo(id=name), WorkerClient(url.removesuffix("/v1"), name))
    with ServerThread(create_app(directory, GatewayConfig(retry_backoff_ms=1))) as front:
        yield front.url


@pytest.fixture
def oai(gateway: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=gateway + "/v1", api_key="k", _strict_response_validation=True, max_retries=0
    ) as client:
        yield client


@pytest.fixture
def claude(gateway: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=gateway, api_key="k", _strict_response_validation=True, max_retries=0
    ) as client:
        yield client


def _chat_format(schema: dict[str, Any], name: str = "answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _valid(text: str, schema: dict[str, Any]) -> Any:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("name", SCHEMAS)
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seed"])
def test_chat_answers_validate(oai: openai.OpenAI, name: str, sampling: dict[str, Any]) -> None:
    schema = SCHEMAS[name]
    completion = oai.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=400,
        response_format=_chat_format(schema, name),  # type: ignore[arg-type]
        **sampling,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    _valid(choice.message.content or "", schema)
    chunks = oai.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=400,
        response_format=_chat_format(schema, name),  # type: ignore[arg-type]
        stream=True,
        **sampling,
    )
    pieces = list(chunks)
    assert pieces[-1].choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert _valid(streamed, schema) == json.loads(choice.message.content or "")


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


def test_the_openai_sdks_parse_helpers(oai: openai.OpenAI) -> None:
    """The SDK writes the (strict) schema from a pydantic model and parses the answer into it."""
    completion = oai.chat.completions.parse(
        model="tiny", messages=USER, max_tokens=200, response_format=Pet
    )
    assert isinstance(completion.choices[0].message.parsed, Pet)
    response = oai.responses.parse(
        model="tiny", input="A pet?", max_output_tokens=200, text_format=Pet
    )
    assert isinstance(response.output_parsed, Pet)


@pytest.mark.parametrize("name", SCHEMAS)
def test_responses_answers_validate(oai: openai.OpenAI, name: str) -> None:
    text_format = {"type": "json_schema", "name": name, "schema": SCHEMAS[name], "strict": True}
    response = oai.responses.create(
        model="tiny", input="Describe it.", max_output_tokens=400, text={"format": text_format}
    )
    assert response.status == "completed"
    _valid(response.output_text, SCHEMAS[name])
    assert response.text is not None and response.text.format.type == "json_schema"
    with oai.responses.stream(
        model="tiny", input="Describe it.", max_output_tokens=400, text={"format": text_format}
    ) as stream:
        final = stream.get_final_response()
    assert final.status == "completed"
    assert _valid(final.output_text, SCHEMAS[name]) == json.loads(response.output_text)


@pytest.mark.parametrize("name", SCHEMAS)
def test_messages_answers_validate(claude: anthropic.Anthropic, name: str) -> None:
    output_config: Any = {"format": {"type": "json_schema", "schema": SCHEMAS[name]}}
    message = claude.messages.create(
        model="tiny", max_tokens=400, messages=USER, output_config=output_config
    )
    assert message.stop_reason == "end_turn"
    (block,) = message.content
    assert block.type == "text"
    _valid(block.text, SCHEMAS[name])
    with claude.messages.stream(
        model="tiny", max_tokens=400, messages=USER, output_config=output_config
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "end_turn"
    assert final.content[0].type == "text"
    assert _valid(final.content[0].text, SCHEMAS[name]) == json.loads(block.text)


def test_batched_requests_each_keep_their_own_schema(gateway: str, workers: dict[str, Any]) -> None:
    """Two schemas and a free-text request at once: all three decode in one batch, each schema's
    answer validates, and the free one is the same junk it is alone (it runs to its limit)."""
    engine: Engine = workers["tiny"][1]
    assert engine.batchable
    alone = _post(gateway, {"max_tokens": 120})
    mark = len(engine.stats.events)
    bodies = {
        "person": {"max_tokens": 400, "response_format": _chat_format(PERSON)},
        "event": {"max_tokens": 400, "response_format": _chat_format(EVENT)},
        "free": {"max_tokens": 120},
    }
    results: dict[str, dict[str, Any]] = {}
    threads = [
        threading.Thread(target=lambda k=k, b=b: results.__setitem__(k, _post(gateway, b)))
        for k, b in bodies.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for name, schema in (("person", PERSON), ("event", EVENT)):
        assert results[name]["choices"][0]["finish_reason"] == "stop"
        _valid(results[name]["choices"][0]["message"]["content"], schema)
    free = results["free"]["choices"][0]
    assert free["finish_reason"] == "length"
    assert free["message"]["content"] == alone["choices"][0]["message"]["content"]
    running = peak = 0
    for kind, _ in list(engine.stats.events)[mark:]:
        running += {"admitted": 1, "finished": -1}.get(kind, 0)
        peak = max(peak, running)
    assert peak == 3  # they were decoded together


def _post(gateway: str, fields: dict[str, Any]) -> dict[str, Any]:
    body = {"model": "tiny", "messages": USER, **fields}
    response = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_cut_short_is_length_on_every_api(oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    completion = oai.chat.completions.create(
        model="tiny", messages=USER, max_tokens=5, response_format=_chat_format(PERSON)
    )  # type: ignore[call-overload]
    assert completion.choices[0].finish_reason == "length"
    text = completion.choices[0].message.content or ""
    assert text.startswith('{"name"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    text_format: Any = {"type": "json_schema", "name": "p", "schema": PERSON}
    response = oai.responses.create(
        model="tiny", input="x", max_output_tokens=5, text={"format": text_format}
    )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    output_config: Any = {"format": {"type": "json_schema", "schema": PERSON}}
    message = claude.messages.create(
        model="tiny", max_tokens=5, messages=USER, output_config=output_config
    )
    assert message.stop_reason == "max_tokens"


def test_json_object_is_an_object(oai: openai.OpenAI) -> None:
    completion = oai.chat.completions.create(
        model="tiny", messages=USER, max_tokens=60, response_format={"type": "json_object"}
    )
    choice = completion.choices[0]
    assert (choice.message.content or "").startswith("{")
    if choice.finish_reason == "stop":  # random keys are unbounded: it may not close in 60
        assert isinstance(json.loads(choice.message.content or ""), dict)


def test_thinking_is_off_with_a_schema(oai: openai.OpenAI) -> None:
    """The think model opens a think block by default; with a schema it answers at once."""
    completion = oai.chat.completions.create(
        model="think",
        messages=USER,
        max_tokens=400,
        reasoning_effort="high",
        response_format=_chat_format(TITLE),  # type: ignore[arg-type]
    )
    message = completion.choices[0].message
    assert not (message.model_extra or {}).get("reasoning_content")
    assert completion.choices[0].finish_reason == "stop"
    _valid(message.content or "", TITLE)


def test_an_unsupported_schema_is_400_in_each_apis_shape(
    oai: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    with pytest.raises(openai.BadRequestError) as chat_error:
        oai.chat.completions.create(
            model="tiny", messages=USER, max_tokens=5, response_format=_chat_format(UNIQUE)
        )  # type: ignore[call-overload]
    assert chat_error.value.param == "response_format.json_schema.schema.properties.ids.uniqueItems"
    assert "uniqueItems" in chat_error.value.message
    text_format: Any = {"type": "json_schema", "name": "u", "schema": UNIQUE}
    with pytest.raises(openai.BadRequestError) as responses_error:
        oai.responses.create(model="tiny", input="x", text={"format": text_format})
    assert responses_error.value.param == "text.format.schema.properties.ids.uniqueItems"
    output_config: Any = {"format": {"type": "json_schema", "schema": UNIQUE}}
    with pytest.raises(anthropic.BadRequestError) as messages_error:
        claude.messages.create(
            model="tiny", max_tokens=5, messages=USER, output_config=output_config
        )
    body = messages_error.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "invalid_request_error"
    assert "output_config.format.schema.properties.ids.uniqueItems" in body["error"]["message"]


@pytest.mark.parametrize("front", ["worker", "gateway"])
def test_the_workers_own_400_reaches_the_client_as_400(
    front: str, gateway: str, workers: dict[str, Any]
) -> None:
    """A schema with tools is refused by the worker (the gateway lets it through): a client
    error with its param, not a 502."""
    base = workers["tiny"][0].removesuffix("/v1") if front == "worker" else gateway
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {
        "model": "tiny",
        "messages": USER,
        "max_tokens": 5,
        "tools": [tool],
        "response_format": _chat_format(TITLE),
    }
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tools"
    body["tool_choice"] = "none"  # the tools are not offered: nothing to refuse
    assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).status_code == 200
