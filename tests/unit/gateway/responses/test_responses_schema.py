"""Every response object and stream event the Responses API emits, against the Open Responses
spec (vendored: tests/fixtures/openresponses, validators in tests/openresponses.py).

The encoder is driven with internal events for each kind of answer (text, cut short, failed
before and after content, tool calls, reasoning, progress notes, usage, sampling values), and the
real gateway app is called in-process for streamed and non-streamed answers. Beyond the spec's
own verdict, the objects must carry no field the spec does not define (its schemas stay open).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from openai.types.responses import ResponseCustomToolCall, ResponseFunctionToolCall
from openresponses import (
    DELIBERATE_EXTRAS,
    RESPONSE,
    check_event,
    check_response,
    event_schemas,
    sse_events,
    undeclared_fields,
    validator,
)

from gateway.answer import Accumulator
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.events import (
    Done,
    Error,
    Event,
    Meta,
    Progress,
    ReasoningDelta,
    Sampling,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from gateway.responses import wire
from gateway.testing import ScriptedUpstream, asgi_request, text_script
from gateway.upstream import ModelInfo, StaticDirectory

MINIMAL = {"model": "m", "input": "x"}
# Every request field the spec defines that this gateway serves, set to a non-default value.
FULL = {
    "model": "m",
    "input": [{"role": "user", "content": [{"type": "input_text", "text": "weather?"}]}],
    "instructions": "be brief",
    "tools": [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            "strict": False,
        },
        {"type": "function", "name": "ping"},
    ],
    "tool_choice": {"type": "function", "name": "get_weather"},
    "parallel_tool_calls": False,
    "max_tool_calls": 3,
    "reasoning": {"effort": "high", "summary": "concise"},
    "text": {"format": {"type": "text"}, "verbosity": "low"},
    "max_output_tokens": 64,
    "temperature": 0.3,
    "top_p": 0.8,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.25,
    "top_logprobs": 2,
    "truncation": "auto",
    "include": ["reasoning.encrypted_content"],
    "stream": True,
    "stream_options": {"include_obfuscation": False},
    "store": False,
    "background": False,
    "service_tier": "flex",
    "metadata": {"job": "42"},
    "safety_identifier": "user-7",
    "prompt_cache_key": "session-9",
}


def _call(index: int, name: str, *fragments: str) -> list[Event]:
    first = ToolCallDelta(index, id=f"call_{index}", name=name, arguments=fragments[0])
    return [first, *(ToolCallDelta(index, arguments=f) for f in fragments[1:])]


SCENARIOS: dict[str, list[Event]] = {
    "text": [TextDelta("Hel"), TextDelta("lo"), Done("stop")],
    "max_output_tokens": [TextDelta("Cut"), TextDelta(" sh"), Usage(5, 16), Done("length")],
    "failure_before_content": [Error(kind="upstream", message="worker died")],
    "failure_after_text": [TextDelta("partial"), Error(kind="upstream", message="worker died")],
    "failure_in_tool_call": [*_call(0, "get_weather", '{"ci'), Error(kind="timeout", message="t")],
    "failure_in_reasoning": [ReasoningDelta("hm"), Error(kind="internal", message="bug")],
    "failure_in_progress_note": [
        Progress("asking 2 models…"),
        Error(kind="overloaded", message="x"),
    ],
    "one_tool_call": [*_call(0, "get_weather", '{"ci', 'ty": "Oslo"}'), Done("tool_calls")],
    "two_tool_calls": [
        TextDelta("Checking."),
        *_call(0, "get_weather", '{"city": "Oslo"}'),
        *_call(1, "ping", ""),
        Done("stop"),  # the model said stop; a tool call is a tool call
    ],
    "reasoning": [ReasoningDelta("let "), ReasoningDelta("me think"), TextDelta("4"), Done()],
    "progress_notes": [Progress("asking 2 models…"), Progress(" b won"), TextDelta("A"), Done()],
    "usage": [TextDelta("counted"), Usage(40, 3, 30), Done()],
    "sampling": [TextDelta("sampled"), Usage(4, 1), Sampling(0.7, 0.95, 20), Done()],
    "everything": [
        Meta({"x-route": "local"}),
        Progress("asking…"),
        ReasoningDelta("think"),
        TextDelta("Hello"),
        *_call(0, "get_weather", '{"city"', ': "Paris"}'),
        Usage(7, 5, 2),
        Sampling(0.2, 0.9),
        Done("tool_calls"),
    ],
}


def _stream(
    body: dict[str, Any], events: list[Event], response_id: str | None = None
) -> tuple[list[dict[str, Any]], wire.ResponsesStreamEncoder]:
    request, parsed = wire.parse(body)
    encoder = wire.ResponsesStreamEncoder(request, parsed, response_id=response_id)
    out = encoder.start_events()
    for event in events:
        out += encoder.events(event)
    return out, encoder


def _body(body: dict[str, Any], events: list[Event], **kwargs: Any) -> dict[str, Any]:
    request, parsed = wire.parse(body)
    acc = Accumulator()
    for event in events:
        acc.add(event)
    return wire.response_body(request, parsed, acc, **kwargs)


def _check_stream(events: list[dict[str, Any]]) -> None:
    """Every event is the spec's, numbered from 0, about one response; items open and close in
    pairs with the same id; exactly one terminal event, last."""
    for event in events:
        check_event(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert len({e["response"]["id"] for e in events if "response" in e}) == 1
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done and len(set(added)) == len(added)
    terminals = ("response.completed", "response.incomplete", "response.failed")
    assert [e["type"] for e in events if e["type"] in terminals] == [events[-1]["type"]]
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == events[-1][
        "response"
    ]["output"]


# -- the encoder, event by event --------------------------------------------------------------------


@pytest.mark.parametrize("body", [MINIMAL, FULL], ids=["minimal", "full"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_stream_event_and_the_body_match_the_spec(name, body):
    events, encoder = _stream(body, SCENARIOS[name])
    _check_stream(events)
    assert encoder.final == events[-1]["response"]
    check_response(_body(body, SCENARIOS[name]))


@pytest.mark.parametrize(
    ("name", "terminal", "status"),
    [
        ("text", "response.completed", "completed"),
        ("max_output_tokens", "response.incomplete", "incomplete"),
        ("failure_after_text", "response.failed", "failed"),
        ("one_tool_call", "response.completed", "completed"),
    ],
)
def test_terminal_event_and_status(name, terminal, status):
    events, _ = _stream(MINIMAL, SCENARIOS[name])
    final = events[-1]
    assert (final["type"], final["response"]["status"]) == (terminal, status)
    # completed_at: null until the response is completed, and only then a time.
    assert all(e["response"]["completed_at"] is None for e in events[:-1] if "response" in e)
    assert (final["response"]["completed_at"] is not None) == (status == "completed")
    details = final["response"]["incomplete_details"]
    assert details == ({"reason": "max_output_tokens"} if status == "incomplete" else None)


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n.startswith("failure")])
def test_failure_is_the_nested_error_event_then_response_failed(name):
    events, encoder = _stream(MINIMAL, SCENARIOS[name])
    error, failed = events[-2:]
    cause = next(e for e in SCENARIOS[name] if isinstance(e, Error))
    code = "rate_limit_exceeded" if cause.kind == "overloaded" else "server_error"
    assert error["type"] == "error" and set(error) == {"type", "sequence_number", "error"}
    assert error["error"]["message"] == cause.message and error["error"]["param"] is None
    assert error["error"]["code"] == cause.kind and error["error"]["type"].endswith("_error")
    assert failed["type"] == "response.failed"
    assert failed["response"]["error"] == {"code": code, "message": cause.message}
    # An item open at the failure is closed as incomplete (reasoning items have no status).
    for item in failed["response"]["output"]:
        assert item.get("status", "incomplete") == "incomplete"
    assert encoder.final is failed["response"]


def test_items_have_exactly_the_spec_fields():
    events, _ = _stream(MINIMAL, SCENARIOS["everything"])
    output = events[-1]["response"]["output"]
    assert [set(item) for item in output] == [
        {"type", "id", "summary"},  # the progress note: a summary, no content
        {"type", "id", "summary", "content"},  # the model's reasoning
        {"type", "id", "status", "role", "content"},
        {"type", "id", "call_id", "name", "arguments", "status"},
    ]
    note, thought, message, call = output
    assert note["summary"] == [{"type": "summary_text", "text": "asking…"}]
    assert thought["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert message["content"] == [
        {"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}
    ]
    assert (call["call_id"], call["name"], call["arguments"]) == (
        "call_0",
        "get_weather",
        '{"city": "Paris"}',
    )
    assert not any("encrypted_content" in item for item in output)  # none unless asked for
    types = [e["type"] for e in events]
    assert "response.reasoning.delta" in types and "response.reasoning.done" in types


def test_the_response_echoes_the_request():
    events, _ = _stream(FULL, [*SCENARIOS["everything"][:-2], Done("tool_calls")])
    created, final = events[0]["response"], events[-1]["response"]
    for response in (created, final):
        assert {k: response[k] for k in FULL if k in response} == {
            "model": "m",
            "instructions": "be brief",
            "tools": [
                {**FULL["tools"][0]},
                {
                    "type": "function",
                    "name": "ping",
                    "description": None,
                    "parameters": None,
                    "strict": None,
                },
            ],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False,
            "max_tool_calls": 3,
            "reasoning": {"effort": "high", "summary": "concise"},
            "text": {"format": {"type": "text"}, "verbosity": "low"},
            "max_output_tokens": 64,
            "temperature": 0.3,  # no Sampling event: the request's values were used
            "top_p": 0.8,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.25,
            "top_logprobs": 2,
            "truncation": "auto",
            "store": False,
            "background": False,
            "service_tier": "default",  # the tier used: the only one there is
            "metadata": {"job": "42"},
            "safety_identifier": "user-7",
            "prompt_cache_key": "session-9",
        }
        assert response["previous_response_id"] is None


def test_defaults_fill_what_the_request_left_out():
    events, _ = _stream(MINIMAL, SCENARIOS["text"])
    for response in (events[0]["response"], events[-1]["response"]):
        assert response["temperature"] == response["top_p"] == 1.0
        assert response["presence_penalty"] == response["frequency_penalty"] == 0.0
        assert (response["top_logprobs"], response["max_tool_calls"]) == (0, None)
        assert (response["store"], response["background"]) == (True, False)
        assert (response["tools"], response["tool_choice"]) == ([], "auto")
        assert response["parallel_tool_calls"] is True and response["truncation"] == "disabled"
        assert response["text"] == {"format": {"type": "text"}, "verbosity": "medium"}
        assert response["reasoning"] == {"effort": None, "summary": None}
        assert (response["metadata"], response["instructions"]) == ({}, None)
        assert response["usage"] is None  # the upstream never said
    assert events[0]["response"]["status"] == "in_progress"


def test_sampling_values_replace_the_requests_once_known():
    body = {**MINIMAL, "temperature": 0.3}
    events, _ = _stream(body, SCENARIOS["sampling"])
    assert (events[0]["response"]["temperature"], events[0]["response"]["top_p"]) == (0.3, 1.0)
    assert (events[-1]["response"]["temperature"], events[-1]["response"]["top_p"]) == (0.7, 0.95)
    assert _body(body, SCENARIOS["sampling"])["temperature"] == 0.7


def test_usage_is_reported():
    events, _ = _stream(MINIMAL, SCENARIOS["usage"])
    usage = events[-1]["response"]["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (40, 3, 43)
    assert usage["input_tokens_details"]["cached_tokens"] == 30
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}


def test_response_id_hook_names_the_response_everywhere():
    events, _ = _stream(MINIMAL, SCENARIOS["text"], response_id="resp_node7_1")
    assert {e["response"]["id"] for e in events if "response" in e} == {"resp_node7_1"}
    assert _body(MINIMAL, SCENARIOS["text"], response_id="resp_node7_2")["id"] == "resp_node7_2"
    assert _stream(MINIMAL, [])[1].shell.id.startswith("resp_")


def test_final_is_set_by_the_terminal_event_only():
    request, parsed = wire.parse(MINIMAL)
    encoder = wire.ResponsesStreamEncoder(request, parsed)
    encoder.start_events()
    encoder.events(TextDelta("a"))
    assert encoder.final is None
    encoder.events(Done())
    assert encoder.final is not None and encoder.final["status"] == "completed"
    assert encoder.final["output"][0]["content"][0]["text"] == "a"


def _ids_out(value: Any) -> Any:
    """``value`` with generated ids and times blanked, to compare two encoders' output."""
    if isinstance(value, dict):
        return {
            k: "·" if k in ("id", "item_id", "created_at", "completed_at") else _ids_out(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_ids_out(v) for v in value]
    return value


def test_sse_frames_are_the_event_dicts():
    request, parsed = wire.parse(MINIMAL)
    sse = wire.ResponsesStreamEncoder(request, parsed)
    raw = sse.start() + b"".join(sse.encode(e) for e in SCENARIOS["everything"])
    dicts, _ = _stream(MINIMAL, SCENARIOS["everything"])
    assert _ids_out(sse_events(raw)) == _ids_out(dicts)
    # The keep-alive is an event (Codex counts only events as activity): in_progress, to spec
    [keepalive] = sse_events(sse.keepalive())
    assert keepalive["type"] == "response.in_progress"
    assert keepalive["sequence_number"] == dicts[-1]["sequence_number"] + 1
    check_event(keepalive)


# -- Codex CLI's tools: namespaced, custom and hosted ----------------------------------------------

CODEX = json.loads((Path(__file__).parents[3] / "fixtures" / "codex_requests.json").read_text())
_PATCH = "*** Begin Patch\n*** Add File: a.txt\n+a\n*** End Patch\n"


@pytest.mark.parametrize("turn", ["first", "tool_output", "gpt-5.5"])
def test_codex_requests_get_spec_valid_responses(turn):
    """Codex's tools echoed as the functions the model saw; reasoning encoded (it asks for
    ``reasoning.encrypted_content``); a plain function call as the spec has it."""
    answer = [*SCENARIOS["everything"][:4], *_call(0, "exec_command", '{"cmd": "ls"}'), Done()]
    events, _ = _stream(CODEX[turn], answer)
    _check_stream(events)
    final = events[-1]["response"]
    assert "web_search" not in [tool["type"] for tool in final["tools"]]
    assert {tool["type"] for tool in final["tools"]} == {"function"}
    thought = next(i for i in final["output"] if i["type"] == "reasoning" and "content" in i)
    assert thought["encrypted_content"].startswith("mlxmesh-reasoning-v1.")


def test_a_namespaced_call_carries_openais_namespace_field():
    events, _ = _stream(
        CODEX["first"], [*_call(0, "multi_agent_v1__close_agent", '{"target": "a"}'), Done()]
    )
    final = events[-1]["response"]
    item = final["output"][0]
    assert (item["name"], item["namespace"]) == ("close_agent", "multi_agent_v1")
    ResponseFunctionToolCall.model_validate(item)  # OpenAI's shape, which has the field
    # The spec's FunctionCall has no namespace (its objects stay open, so it is valid there):
    # the one field beyond it, and only for a client that declared a namespace tool.
    assert validator(RESPONSE).is_valid(final)
    assert undeclared_fields(final, RESPONSE) == ["output.namespace"]
    check_response({**final, "output": [{k: v for k, v in item.items() if k != "namespace"}]})


def test_a_custom_tool_call_is_openais_custom_tool_call_item():
    """A departure from the spec (it has no such item): only for a client that declared a custom
    tool, which only OpenAI's API knows. No input deltas: the input is plain text at the end."""
    arguments = json.dumps({"input": _PATCH})
    events, encoder = _stream(
        CODEX["gpt-5.5"], [*_call(0, "apply_patch", arguments[:9], arguments[9:]), Done()]
    )
    added, done = (e for e in events if e["type"].startswith("response.output_item."))
    assert added["item"]["input"] == "" and done["item"]["input"] == _PATCH
    item = ResponseCustomToolCall.model_validate(done["item"])
    assert (item.type, item.name, item.call_id) == ("custom_tool_call", "apply_patch", "call_0")
    assert not any("function_call_arguments" in e["type"] for e in events)
    assert encoder.final is not None and encoder.final["output"] == [done["item"]]
    request, parsed = wire.parse(CODEX["gpt-5.5"])
    acc = Accumulator()
    for event in _call(0, "apply_patch", arguments):
        acc.add(event)
    acc.add(Done())
    assert wire.response_body(request, parsed, acc)["output"][0]["input"] == _PATCH


def test_hosted_tools_are_named_in_a_header():
    body = {**CODEX["gpt-5.5"], "model": "full", "stream": False}
    result = asyncio.run(asgi_request(_app(), "POST", "/v1/responses", body))
    assert result.status == 200, result.body
    assert result.headers["x-tools-ignored"] == "tool_search,web_search"
    streamed = asyncio.run(asgi_request(_app(), "POST", "/v1/responses", {**body, "stream": True}))
    assert streamed.headers["x-tools-ignored"] == "tool_search,web_search"
    plain = asyncio.run(asgi_request(_app(), "POST", "/v1/responses", {**FULL, "model": "full"}))
    assert "x-tools-ignored" not in plain.headers


# -- the validator is as strict as the spec ---------------------------------------------------------


def test_the_validator_rejects_what_the_spec_rejects():
    events, _ = _stream(MINIMAL, SCENARIOS["failure_after_text"])
    good = events[-1]["response"]
    for broken in (
        {k: v for k, v in good.items() if k != "presence_penalty"},  # a required field missing
        {**good, "temperature": None},  # a number, never null
        {**good, "error": {"code": "server_error"}},  # the Error's message missing
        {**good, "user": "u"},  # a field the spec does not define
        {**good, "output": [{**good["output"][0], "role": "tool"}]},
    ):
        with pytest.raises(AssertionError):
            check_response(broken)
    flat_error = {"type": "error", "sequence_number": 0, "code": "x", "message": "m", "param": None}
    with pytest.raises(AssertionError):
        check_event(flat_error)
    with pytest.raises(AssertionError):
        check_event({**events[3], "type": "response.reasoning_text.delta"})
    assert "response.reasoning.delta" in event_schemas()


def test_the_deliberate_extras_are_only_the_listed_ones():
    """Our own check, stricter than the spec (which never closes its objects): apart from
    DELIBERATE_EXTRAS, nothing in the response object or its items is undefined there."""
    events, _ = _stream(FULL, SCENARIOS["everything"])
    final = events[-1]["response"]
    assert undeclared_fields(final, RESPONSE) == []
    assert final["usage"]["input_tokens_details"]["cache_write_tokens"] == 0
    assert DELIBERATE_EXTRAS == {"usage.input_tokens_details.cache_write_tokens"}


# -- through the real gateway app -------------------------------------------------------------------

SCRIPTS: dict[str, list] = {
    "full": text_script(
        "Hello there!", reasoning="let me think", tool_calls=[("get_weather", '{"city": "Oslo"}')]
    ),
    "cut": text_script("Cut short", finish="length"),
    "broken": [TextDelta("partial "), Error(kind="upstream", message="worker died")],
    "sampled": [*text_script("Sampled.", usage=Usage(3, 2))[:-1], Sampling(0.6, 0.9), Done()],
}


def _app():
    directory = StaticDirectory()
    for name, script in SCRIPTS.items():
        directory.add(ModelInfo(id=name), ScriptedUpstream.of(*script, name=name))
    return create_app(directory, GatewayConfig(retry_backoff_ms=1))


@pytest.mark.parametrize("model", list(SCRIPTS))
def test_gateway_stream_matches_the_spec(model):
    body = {**FULL, "model": model, "tool_choice": "auto", "stream": True}
    result = asyncio.run(asgi_request(_app(), "POST", "/v1/responses", body))
    assert result.status == 200 and result.headers["content-type"].startswith("text/event-stream")
    events = sse_events(result.body)
    _check_stream(events)
    final = events[-1]["response"]
    assert final["model"] == model and final["service_tier"] == "default"
    if model == "sampled":
        assert (final["temperature"], final["top_p"]) == (0.6, 0.9)
    if model == "broken":
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        assert events[-2]["error"]["message"] == "worker died"


@pytest.mark.parametrize("model", ["full", "cut", "sampled"])
def test_gateway_body_matches_the_spec(model):
    body = {**FULL, "model": model, "tool_choice": "auto", "stream": False}
    result = asyncio.run(asgi_request(_app(), "POST", "/v1/responses", body))
    assert result.status == 200, result.body
    response = result.json()
    check_response(response)
    assert response["status"] == ("incomplete" if model == "cut" else "completed")
    assert response["store"] is False and response["prompt_cache_key"] == "session-9"
    if model == "full":
        assert [i["type"] for i in response["output"]] == ["reasoning", "message", "function_call"]
