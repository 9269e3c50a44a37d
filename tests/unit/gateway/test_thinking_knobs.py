"""Every thinking knob is parsed once, at the public edge, and every route agrees on the result.

One table of knob shapes, sent through each API's parser: the direct route (what the worker is
told) and the ``model="mesh"`` route (thinking off unless opted in) must both follow the single
normalised ``ChatRequest.reasoning``; nothing downstream re-reads the raw knobs.
"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.api import chat, messages
from gateway.moa.candidates import worker_request
from gateway.request import ChatRequest
from gateway.responses import wire
from gateway.worker_client import worker_body
from worker.chat.thinking import normalize_thinking

# (knob fields, what they ask for: True on, False off, None the model's default)
KNOBS: list[tuple[dict[str, Any], bool | None]] = [
    ({}, None),
    ({"reasoning_effort": "high"}, True),
    ({"reasoning_effort": "none"}, False),
    ({"reasoning": {"effort": "low"}}, True),
    ({"reasoning": {"enabled": False}}, False),
    ({"reasoning": {"max_tokens": 256}}, True),
    ({"enable_thinking": True}, True),
    ({"enable_thinking": "off"}, False),
    ({"enableThinking": 1}, True),
    ({"thinking_budget": 512}, True),
    ({"thinking_budget": 0}, False),
    ({"reasoning_budget": 512}, True),
    ({"max_thinking_tokens": 128}, True),
    ({"thinking": {"type": "enabled", "budget_tokens": 64}}, True),
    ({"thinking": {"type": "disabled"}}, False),
    ({"thinking": {"type": "adaptive"}}, True),
    ({"chat_template_kwargs": {"enable_thinking": True}}, True),
    ({"chat_template_kwargs": {"enable_thinking": False}}, False),
    ({"chat_template_kwargs": {"thinking": True}}, True),
    ({"chat_template_kwargs": {"thinking": "off"}}, False),
    ({"chat_template_kwargs": {"thinking": "auto"}}, None),
    ({"chat_template_kwargs": {"thinking": {"type": "enabled"}}}, True),
    ({"chat_template_kwargs": {"reasoning": True}}, True),
    ({"chat_template_kwargs": {"reasoning_effort": "medium"}}, True),
    ({"chat_template_kwargs": {"reasoning_budget": 512}}, True),
    ({"chat_template_kwargs": {"thinking_budget": 0}}, False),
    ({"chat_template_kwargs": {"enable_reasoning": "true"}}, True),
    ({"chat_template_kwargs": {"foo": 1}}, None),
    # Precedence: template kwargs, then explicit booleans, then the rest.
    ({"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "high"}, False),
    ({"enable_thinking": False, "reasoning_effort": "high"}, False),
    ({"thinking": {"type": "disabled"}, "thinking_budget": 100}, False),
]

HI = [{"role": "user", "content": "hi"}]


def _parse_chat(fields: dict[str, Any]):
    return chat.parse({"model": "m", "messages": HI, **fields})[0]


def _parse_responses(fields: dict[str, Any]):
    return wire.parse({"model": "m", "input": "hi", **fields})[0]


def _parse_messages(fields: dict[str, Any]):
    return messages.parse({"model": "m", "max_tokens": 16, "messages": HI, **fields})[0]


PARSERS = {"chat": _parse_chat, "responses": _parse_responses, "messages": _parse_messages}


@pytest.mark.parametrize("api", sorted(PARSERS))
@pytest.mark.parametrize(("fields", "asked"), KNOBS, ids=[str(f) for f, _ in KNOBS])
def test_every_route_follows_the_one_normalised_setting(api, fields, asked) -> None:
    request = PARSERS[api](fields)
    assert request.reasoning is asked, f"{api} parsed {fields} as {request.reasoning}"

    # Direct route: the worker's own normaliser reads the body we send it the same way.
    direct = worker_body(request, "m")
    assert normalize_thinking(direct) is asked

    # model="mesh": off unless the caller opted in, whatever the spelling.
    mixed = worker_request(request, "m", name="m")
    assert mixed.reasoning is (asked is True)
    assert normalize_thinking(worker_body(mixed, "m")) is (asked is True)


def test_a_vote_samples_temperature_floor_reaches_the_worker_only_without_a_temperature():
    floored = ChatRequest(model="m", messages=[], min_temperature=0.5)
    assert worker_body(floored, "m")["min_temperature"] == 0.5
    fixed = floored.model_copy(update={"temperature": 0.0})
    assert "min_temperature" not in worker_body(fixed, "m")
    # A client's own metadata is not a way to set it (Responses copies metadata through).
    caller = ChatRequest(model="m", messages=[], metadata={"min_temperature": "hot"})
    assert "min_temperature" not in worker_body(caller, "m")
