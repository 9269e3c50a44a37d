"""Forced tool calls end to end: ``tool_choice`` "required" or a named function over the real worker
(Chat) and through the gateway (Responses ``required`` / ``{"type": "function", "name"}``,
Anthropic ``any`` / ``{"type": "tool", "name"}``).

The random-weight model never writes a tool call by itself; with the choice forced it must always
write one parsable call to an allowed tool with arguments valid against that tool's schema. The
scripted tool model calls ``get_weather`` as it would anyway, and a named other tool wins over it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.testing import ServerThread
from gateway.upstream import ModelInfo, StaticDirectory
from gateway.worker_client import WorkerClient
from worker.testing import run_worker_in_thread

WORD = {"type": "string", "maxLength": 8}
WEATHER = {
    "type": "object",
    "properties": {"city": WORD, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CALC = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -999, "maximum": 999},
        "op": {"enum": ["+", "-", "*", "/"]},
        "b": {"type": "integer", "minimum": -999, "maximum": 999},
    },
    "required": ["a", "op", "b"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "calculate": CALC}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": name, "description": name, "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLINGS = [{}, {"temperature": 1.0, "seed": 3}, {"temperature": 1.0, "seed": 11}]


@pytest.fixture(scope="module")
def workers(
    tiny_model_dir: Path, tiny_tool_model_dir: Path, tiny_think_model_dir: Path
) -> Iterator[dict[str, str]]:
    with (
        run_worker_in_thread(tiny_model_dir, name="tiny") as (plain, _),
        run_worker_in_thread(tiny_tool_model_dir, name="tool") as (tool, _),
        run_worker_in_thread(tiny_think_model_dir, name="think") as (think, _),
    ):
        yield {"tiny": plain, "tool": tool, "think": think}


@pytest.fixture(scope="module")
def gateway(workers: dict[str, str]) -> Iterator[str]:
    directory = StaticDirectory()
    for name, url in workers.items():
        directory.add(ModelInfo(id=name), WorkerClient(url.removesuffix("/v1"), name))
    with ServerThread(create_app(directory, GatewayConfig(retry_backoff_ms=1))) as front:
        yield front.url


def _chat(url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", json={"messages": ASK, **body}, timeout=120)


def _valid(name: str, arguments: str | dict[str, Any], allowed: tuple[str, ...]) -> None:
    assert name in allowed
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(value, SCHEMAS[name])


def test_without_a_forced_choice_the_random_model_calls_nothing(workers: dict[str, str]) -> None:
    """The premise of the tests below: the random model only ever calls by force."""
    reply = _chat(workers["tiny"], tools=CHAT_TOOLS, tool_choice="auto", max_tokens=40).json()
    assert "tool_calls" not in reply["choices"][0]["message"]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seed3", "seed11"])
@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "calculate"}}],
    ids=["required", "named"],
)
def test_chat_forced_choice_always_yields_a_valid_call(
    workers: dict[str, str], choice: Any, sampling: dict[str, Any]
) -> None:
    allowed = tuple(SCHEMAS) if choice == "required" else ("calculate",)
    body = {"tools": CHAT_TOOLS, "tool_choice": choice, "max_tokens": 300, **sampling}
    reply = _chat(workers["tiny"], **body)
    assert reply.status_code == 200, reply.text
    choice0 = reply.json()["choices"][0]
    assert choice0["finish_reason"] == "tool_calls"
    (call,) = choice0["message"]["tool_calls"]
    _valid(call["function"]["name"], call["function"]["arguments"], allowed)
    with httpx.stream(
        "POST",
        f"{workers['tiny']}/chat/completions",
        json={"messages": ASK, **body, "stream": True},
        timeout=120,
    ) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line[6:7] == "{"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    pieces = [t for d in deltas for t in d.get("tool_calls") or []]
    name = "".join(p.get("function", {}).get("name") or "" for p in pieces)
    arguments = "".join(p.get("function", {}).get("arguments") or "" for p in pieces)
    _valid(name, arguments, allowed)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_named_choice_wins_over_what_the_model_would_call(workers: dict[str, str]) -> None:
    """The scripted model calls get_weather by itself; named calculate, it must call that."""
    url = workers["tool"]
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}}]
    tools.append(CHAT_TOOLS[1])  # calculate
    natural = _chat(url, tools=tools, max_tokens=100).json()["choices"][0]["message"]
    assert natural["tool_calls"][0]["function"]["name"] == "get_weather"
    named = {"type": "function", "function": {"name": "calculate"}}
    forced = _chat(url, tools=tools, tool_choice=named, max_tokens=100).json()
    (call,) = forced["choices"][0]["message"]["tool_calls"]
    _valid(call["function"]["name"], call["function"]["arguments"], ("calculate",))
    required = _chat(url, tools=tools, tool_choice="required", max_tokens=100).json()
    (call,) = required["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] in ("get_weather", "calculate")
    json.loads(call["function"]["arguments"])


def test_a_forced_call_is_not_held_up_by_thinking(workers: dict[str, str]) -> None:
    """Thinking asked for, the think model would open a think block: forced, it calls at once."""
    body = {"tools": CHAT_TOOLS, "tool_choice": "required", "reasoning_effort": "high"}
    reply = _chat(workers["think"], max_tokens=300, **body).json()
    message = reply["choices"][0]["message"]
    assert not message.get("reasoning_content")
    (call,) = message["tool_calls"]
    _valid(call["function"]["name"], call["function"]["arguments"], tuple(SCHEMAS))


@pytest.mark.parametrize(
    "body",
    [
        {"tool_choice": "required"},  # nothing to call
        {"tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
        {"tools": CHAT_TOOLS, "tool_choice": "sometimes"},
    ],
)
def test_impossible_choices_are_400_naming_tool_choice(
    workers: dict[str, str], body: dict[str, Any]
) -> None:
    reply = _chat(workers["tiny"], max_tokens=10, **body)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "tool_choice"


RESPONSES_TOOLS = [
    {"type": "function", "name": name, "description": name, "parameters": schema, "strict": True}
    for name, schema in SCHEMAS.items()
]


@pytest.mark.parametrize(
    ("choice", "allowed"),
    [("required", tuple(SCHEMAS)), ({"type": "function", "name": "calculate"}, ("calculate",))],
    ids=["required", "named"],
)
def test_responses_forced_choice(gateway: str, choice: Any, allowed: tuple[str, ...]) -> None:
    with openai.OpenAI(base_url=gateway + "/v1", api_key="k", max_retries=0) as client:
        for sampling in SAMPLINGS:
            response = client.responses.create(
                model="tiny",
                input="What is the weather in Paris?",
                tools=RESPONSES_TOOLS,  # type: ignore[arg-type]
                tool_choice=choice,
                max_output_tokens=300,
                extra_body=sampling,
            )
            calls = [item for item in response.output if item.type == "function_call"]
            assert len(calls) == 1, response.output
            _valid(calls[0].name, calls[0].arguments, allowed)


@pytest.mark.parametrize(
    ("choice", "allowed"),
    [({"type": "any"}, tuple(SCHEMAS)), ({"type": "tool", "name": "calculate"}, ("calculate",))],
    ids=["any", "named"],
)
def test_anthropic_forced_choice(gateway: str, choice: Any, allowed: tuple[str, ...]) -> None:
    tools: Any = [
        {"name": name, "description": name, "input_schema": schema}
        for name, schema in SCHEMAS.items()
    ]
    with anthropic.Anthropic(base_url=gateway, api_key="k", max_retries=0) as client:
        for sampling in SAMPLINGS:
            message = client.messages.create(
                model="tiny",
                max_tokens=300,
                messages=ASK,  # type: ignore[arg-type]
                tools=tools,
                tool_choice=choice,
                extra_body=sampling,
            )
            assert message.stop_reason == "tool_use"
            (block,) = [b for b in message.content if b.type == "tool_use"]
            _valid(block.name, block.input, allowed)  # type: ignore[arg-type]
