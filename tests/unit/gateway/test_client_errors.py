"""Client mistakes get a 4xx in the API's own error shape, and the connection stays usable.

One real gateway (uvicorn on loopback) over a scripted upstream; every request goes over one
kept-alive httpx connection, and each case checks that the next good request reuses it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.routing import Route

from gateway.api import messages as messages_api
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.request import ChatRequest
from gateway.testing import ScriptedUpstream, ServerThread, text_script
from gateway.upstream import ModelInfo, StaticDirectory

USER = [{"role": "user", "content": "x"}]
CHAT = {"model": "m", "messages": USER}
RESPONSES = {"model": "m", "input": "x"}
MESSAGES = {"model": "m", "max_tokens": 4, "messages": USER}
COUNT = {"model": "m", "messages": USER}


class _BrokenCounter(ScriptedUpstream):
    """An upstream whose token counter has a bug: a server fault, not a client mistake."""

    async def count_tokens(self, request: ChatRequest) -> int | None:
        raise RuntimeError("counter bug")


async def _boom(request: Request) -> None:
    raise RuntimeError("route bug")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), ScriptedUpstream.of(*text_script("ok")))
    directory.add(ModelInfo(id="broken"), _BrokenCounter.of(*text_script("ok")))
    app = create_app(
        directory,
        GatewayConfig(retry_backoff_ms=1),
        extra_routes=[Route("/v1/boom", _boom, methods=["POST"])],
    )
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, limits=httpx.Limits(max_connections=1)) as client:
        yield client


def _local_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def _post(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    return http.post(path, json=body)


def assert_openai_error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    return error


def assert_anthropic_error(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    payload = response.json()
    assert payload["type"] == "error"
    assert isinstance(payload["error"]["type"], str) and payload["error"]["message"]
    return payload["error"]


def assert_still_serving(http: httpx.Client, bad: httpx.Response) -> None:
    """The same kept-alive connection answers a good request after the bad one."""
    assert "close" not in bad.headers.get("connection", "")
    good = _post(http, "/v1/chat/completions", CHAT)
    assert good.status_code == 200, good.text
    assert _local_port(good) == _local_port(bad), "the server dropped the connection"


# -- Responses: wrong-typed tools and input items ------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "where"),
    [
        ({"tools": [{"type": "function", "name": 5}]}, "tools.0.name"),
        ({"tools": [{"type": "function", "name": "f", "parameters": "s"}]}, "tools.0.parameters"),
        ({"tools": [{"type": "function", "name": "f", "description": []}]}, "tools.0.description"),
        ({"input": [{"type": "function_call", "call_id": 1, "name": "f"}]}, "input.0.call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": None}]}, "input.0.name"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
            "input.0.arguments",
        ),
        ({"input": [{"type": "function_call_output", "call_id": 5}]}, "input.0.call_id"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]},
            "input.0.output",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]}, "input.0"),
        ({"input": [{"type": "reasoning", "summary": "s"}]}, "input.0.summary"),
        ({"input": ["just a string"]}, "input.0"),
        ({"tool_choice": {"type": "function", "name": 7}}, "tool_choice"),
        ({"reasoning": {"effort": {"level": "high"}}}, "reasoning.effort"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"store": 3}, "store"),
        ({"service_tier": "turbo"}, "service_tier"),
        ({"text": {"format": {"type": "json"}}}, "text.format.type"),
        (
            {"text": {"format": {"type": "json_schema", "name": "a", "schema": {"if": {}}}}},
            "text.format.schema.if",
        ),
    ],
)
def test_responses_wrong_types_are_400(
    http: httpx.Client, extra: dict[str, Any], where: str
) -> None:
    bad = _post(http, "/v1/responses", {**RESPONSES, **extra})
    error = assert_openai_error(bad)
    assert error["message"].startswith(where), error
    assert_still_serving(http, bad)


# -- Messages and count_tokens: tool_result content and blocks -----------------------------------


def _tool_result(content: Any) -> dict[str, Any]:
    block = {"type": "tool_result", "tool_use_id": "toolu_1", "content": content}
    return {"role": "user", "content": [block]}


# The call a tool result answers (without it the result is an orphan, a 400 of its own).
TOOL_USE = {
    "role": "assistant",
    "content": [{"type": "tool_use", "id": "toolu_1", "name": "read", "input": {}}],
}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize(
    "message",
    [
        _tool_result(5),
        _tool_result(["a", "b"]),  # not valid: the API takes a string or a list of blocks
        _tool_result([{"type": "text", "text": 5}]),
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": 9, "content": "x"}]},
        {"role": "user", "content": ["plain string in a block list"]},
        {"role": "user", "content": [{"type": "text", "text": None}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": 3, "input": {}}]},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 1}],
        },
        {"role": "assistant", "content": [{"type": "thinking", "thinking": 2}]},
    ],
)
def test_messages_wrong_block_types_are_400(
    http: httpx.Client, path: str, message: dict[str, Any]
) -> None:
    body = {**(MESSAGES if path == "/v1/messages" else COUNT), "messages": [message]}
    bad = _post(http, path, body)
    error = assert_anthropic_error(bad)
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("messages.0.content"), error
    assert_still_serving(http, bad)


def test_tool_result_with_text_blocks_is_accepted(http: httpx.Client) -> None:
    answer = _tool_result([{"type": "text", "text": "sunny"}])
    body = {**MESSAGES, "messages": [USER[0], TOOL_USE, answer]}
    assert _post(http, "/v1/messages", body).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_an_image_in_a_tool_result_becomes_a_placeholder_not_a_400(
    http: httpx.Client, stream: bool
) -> None:
    """Claude Code's Read on a PNG: a 400 would stay in the session's history for good."""
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"},
    }
    content = [{"type": "text", "text": "the file:"}, image]
    body = {**MESSAGES, "messages": [USER[0], TOOL_USE, _tool_result(content)], "stream": stream}
    ok = _post(http, "/v1/messages", body)
    assert ok.status_code == 200, ok.text
    assert ok.headers["x-content-replaced"] == "1 tool_result image(s): text-only model"
    request, _ = messages_api.parse(body)
    assert request.messages[-1].content == "the file:\n" + messages_api.IMAGE_PLACEHOLDER
    in_user_turn = {**MESSAGES, "messages": [{"role": "user", "content": [image]}]}
    assert _post(http, "/v1/messages", in_user_turn).status_code == 400  # the user's own: refused
    assert _post(http, "/v1/messages/count_tokens", {**COUNT, **body}).status_code == 200


@pytest.mark.parametrize(
    "extra",
    [
        {"system": [{"type": "text", "text": 1}]},
        {"system": 5},
        {"tools": [{"name": "f", "input_schema": "nope"}]},
        {"tools": [{"name": 1}]},
        {"tool_choice": {"type": "banana"}},
        {"tool_choice": {"type": "tool"}},  # a named choice needs the name
        {"tool_choice": 3},
        {"thinking": 5},
        {"thinking": {"type": "enabled", "budget_tokens": "lots"}},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": "hi"},
        {"model": 5},
    ],
)
def test_count_tokens_validates_its_fields_like_messages(
    http: httpx.Client, extra: dict[str, Any]
) -> None:
    for path, base in (("/v1/messages", MESSAGES), ("/v1/messages/count_tokens", COUNT)):
        bad = _post(http, path, {**base, **extra})
        assert_anthropic_error(bad)
        assert_still_serving(http, bad)


@pytest.mark.parametrize(
    ("extra", "where"),
    [
        ({"messages": []}, "messages"),
        ({"stream": "yes"}, "stream"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop_sequences": "x"}, "stop_sequences"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),  # strict, as Anthropic's API: a string is no number
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": "x"}, "top_k"),
        ({"top_p": "high"}, "top_p"),
        ({"metadata": "x"}, "metadata"),
    ],
)
def test_count_tokens_checks_what_only_generating_uses_as_messages_does(
    http: httpx.Client, extra: dict[str, Any], where: str
) -> None:
    """Issue #44: count_tokens answered 200 to these; it takes a Messages body (max_tokens
    optional) and refuses what /v1/messages refuses, in Anthropic's error shape."""
    for path, base in (("/v1/messages", MESSAGES), ("/v1/messages/count_tokens", COUNT)):
        bad = _post(http, path, {**base, **extra})
        error = assert_anthropic_error(bad)
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith(where), (path, error)
        assert_still_serving(http, bad)
    knobs = {"stream": True, "temperature": 0.5, "stop_sequences": ["x"], "top_k": 3, "top_p": 1}
    full = {**COUNT, **knobs, "max_tokens": 5, "metadata": {"user_id": "u"}}
    assert _post(http, "/v1/messages/count_tokens", full).status_code == 200


# -- Tool results that answer no call ------------------------------------------------------------


def _chat_tool_turns(answered_id: str) -> list[dict[str, Any]]:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    return [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": answered_id, "content": "42"},
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_tool_message_that_answers_no_call_is_400(http: httpx.Client, stream: bool) -> None:
    """Issue #44: answered 200 before, as if the model had asked; Responses refused it."""
    bad = _post(http, "/v1/chat/completions", {**CHAT, "messages": _chat_tool_turns("call_9"), "stream": stream})  # fmt: skip
    error = assert_openai_error(bad)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "messages.2.tool_call_id" and "'call_9'" in error["message"]
    assert_still_serving(http, bad)
    alone = [*USER, {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    assert assert_openai_error(_post(http, "/v1/chat/completions", {**CHAT, "messages": alone}))
    good = _post(http, "/v1/chat/completions", {**CHAT, "messages": _chat_tool_turns("call_1")})
    assert good.status_code == 200, good.text


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_tool_result_that_answers_no_tool_use_is_400(http: httpx.Client, path: str) -> None:
    base = MESSAGES if path == "/v1/messages" else COUNT
    orphan = {"type": "tool_result", "tool_use_id": "toolu_9", "content": "42"}
    turns = [USER[0], TOOL_USE, {"role": "user", "content": [orphan]}]
    bad = _post(http, path, {**base, "messages": turns})
    error = assert_anthropic_error(bad)
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("messages.2.content.0.tool_use_id"), error
    assert "'toolu_9'" in error["message"]
    assert_still_serving(http, bad)
    # A result before its call answers nothing either.
    early = [{"role": "user", "content": [orphan | {"tool_use_id": "toolu_1"}]}, TOOL_USE]
    assert_anthropic_error(_post(http, path, {**base, "messages": early}))
    answered = [USER[0], TOOL_USE, _tool_result("42")]
    assert _post(http, path, {**base, "messages": answered}).status_code == 200


# -- Chat Completions: template kwargs, seed, logit_bias -----------------------------------------


@pytest.mark.parametrize(
    "key", ["tokenize", "add_generation_prompt", "conversation", "messages", "tools"]
)
def test_chat_template_kwargs_that_collide_with_the_template_call_are_400(
    http: httpx.Client, key: str
) -> None:
    bad = _post(http, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {key: True}})
    error = assert_openai_error(bad)
    assert error["param"] == "chat_template_kwargs"
    assert repr(key) in error["message"]
    assert_still_serving(http, bad)


def test_chat_template_kwargs_that_are_template_variables_pass_through(
    http: httpx.Client,
) -> None:
    body = {**CHAT, "chat_template_kwargs": {"enable_thinking": False, "custom_flag": [1]}}
    assert _post(http, "/v1/chat/completions", body).status_code == 200


@pytest.mark.parametrize("seed", [-1, 0, 2**63 - 1, -(2**63)])
def test_seeds_in_the_documented_int64_range_are_accepted(http: httpx.Client, seed: int) -> None:
    assert _post(http, "/v1/chat/completions", {**CHAT, "seed": seed}).status_code == 200


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30, 1.5, [1]])
def test_seeds_outside_int64_are_400(http: httpx.Client, seed: Any) -> None:
    bad = _post(http, "/v1/chat/completions", {**CHAT, "seed": seed})
    assert assert_openai_error(bad)["param"] == "seed"
    assert_still_serving(http, bad)


@pytest.mark.parametrize(
    "bias", [{"x": 1}, {"-1": 1}, {"5": 101}, {"5": -100.5}, {"5": "high"}, [1, 2], {"1.5": 1}]
)
def test_bad_logit_bias_is_400(http: httpx.Client, bias: Any) -> None:
    bad = _post(http, "/v1/chat/completions", {**CHAT, "logit_bias": bias})
    assert assert_openai_error(bad)["param"].startswith("logit_bias")
    assert_still_serving(http, bad)


# -- Bodies that are not objects -----------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"]
)
@pytest.mark.parametrize("raw", [b"", b"[]", b'"text"', b"null", b"{", b"\xff\xfe", b"12"])
def test_bodies_that_are_not_json_objects_are_400(
    http: httpx.Client, path: str, raw: bytes
) -> None:
    bad = http.post(path, content=raw, headers={"content-type": "text/plain"})
    if path.startswith("/v1/messages"):
        assert_anthropic_error(bad)
    else:
        assert_openai_error(bad)
    assert_still_serving(http, bad)


# -- Server bugs: a 500 in the API's shape, logged, connection kept ------------------------------


def test_a_bug_in_a_route_is_a_json_500_logged_with_its_traceback(
    http: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        bad = http.post("/v1/boom", json={})
    error = assert_openai_error(bad, 500)
    assert error["type"] == "server_error"
    assert "route bug" not in error["message"]  # internals stay in the log
    logged = [r for r in caplog.records if r.exc_info and "route bug" in str(r.exc_info[1])]
    assert logged, "the traceback was not logged"
    assert_still_serving(http, bad)


def test_a_bug_in_count_tokens_is_an_anthropic_500(http: httpx.Client) -> None:
    bad = _post(http, "/v1/messages/count_tokens", {**COUNT, "model": "broken"})
    assert assert_anthropic_error(bad, 500)["type"] == "api_error"
    assert_still_serving(http, bad)
