"""The three client APIs, exact on the wire: official SDKs with strict response validation
against a gateway on loopback over scripted upstreams."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.events import Done, Error, TextDelta, Usage
from gateway.testing import ScriptedUpstream, ServerThread, text_script
from gateway.upstream import ModelInfo, StaticDirectory

FULL = text_script(
    "Hello there, friend!",
    reasoning="let me think",
    tool_calls=[("get_weather", '{"city": "Paris"}')],
)
SCRIPTS = {
    "full": FULL,
    "plain": text_script("Just text."),
    "cut": text_script("Cut short", finish="length"),
    "broken": [
        TextDelta("partial "),
        TextDelta("answer"),
        Error(kind="upstream", message="worker died"),
    ],
    "refused": [Error(kind="invalid_request", message="context_length_exceeded: too long")],
    "empty": [Usage(3, 0), Done("stop")],
    "stopped": [TextDelta("Up to "), Usage(4, 2), Done("stop", stop_sequence="###")],
    "counted": [Usage(40, 0), *text_script("Counted.", usage=Usage(40, 3, 30))],
}


@pytest.fixture(scope="module")
def server():
    directory = StaticDirectory()
    for name, script in SCRIPTS.items():
        directory.add(ModelInfo(id=name), ScriptedUpstream.of(*script, name=name))
    app = create_app(directory, GatewayConfig(retry_backoff_ms=1))
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture
def oai(server):
    with openai.OpenAI(
        base_url=server.url + "/v1", api_key="k", _strict_response_validation=True, max_retries=0
    ) as client:
        yield client


@pytest.fixture
def claude(server):
    with anthropic.Anthropic(
        base_url=server.url, api_key="k", _strict_response_validation=True, max_retries=0
    ) as client:
        yield client


USER = [{"role": "user", "content": "hi"}]


# -- chat completions --------------------------------------------------------------------------


def test_chat_create_full(oai):
    completion = oai.chat.completions.create(model="full", messages=USER)
    choice = completion.choices[0]
    assert choice.message.content == "Hello there, friend!"
    assert choice.message.model_extra["reasoning_content"] == "let me think"
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.id, call.function.name, call.function.arguments) == (
        "call_0",
        "get_weather",
        '{"city": "Paris"}',
    )
    assert completion.usage.prompt_tokens == 7
    assert completion.usage.prompt_tokens_details.cached_tokens == 2


def test_chat_stream_chunks(oai):
    chunks = list(
        oai.chat.completions.create(
            model="full", messages=USER, stream=True, stream_options={"include_usage": True}
        )
    )
    with_choices = [c for c in chunks if c.choices]
    roles = [c.choices[0].delta.role for c in with_choices]
    assert roles[0] == "assistant" and not any(roles[1:])
    reasoning = "".join(
        c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in with_choices
    )
    assert reasoning == "let me think"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == "Hello there, friend!"
    fragments = [tc for c in with_choices for tc in c.choices[0].delta.tool_calls or []]
    assert fragments[0].id == "call_0" and fragments[0].function.name == "get_weather"
    assert all(f.id is None and f.function.name is None and f.type is None for f in fragments[1:])
    assert "".join(f.function.arguments for f in fragments) == '{"city": "Paris"}'
    assert with_choices[-1].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens == 2
    assert len({c.id for c in chunks}) == 1


def test_chat_stream_helper_final(oai):
    with oai.chat.completions.stream(model="plain", messages=USER) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "Just text."
    assert final.choices[0].finish_reason == "stop"


def test_chat_truncated(oai):
    completion = oai.chat.completions.create(model="cut", messages=USER, max_tokens=3)
    assert completion.choices[0].finish_reason == "length"


def test_chat_midstream_error_raises(oai):
    stream = oai.chat.completions.create(model="broken", messages=USER, stream=True)
    got = []
    with pytest.raises(openai.APIError, match="worker died"):
        for chunk in stream:
            got.append(chunk.choices[0].delta.content)
    assert "partial " in got


def test_chat_error_before_content_is_http_status(oai):
    with pytest.raises(openai.BadRequestError, match="context_length_exceeded"):
        oai.chat.completions.create(model="refused", messages=USER, stream=True)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="refused", messages=USER)


def test_unknown_model_404_lists_models(oai):
    with pytest.raises(openai.NotFoundError, match="available: full"):
        oai.chat.completions.create(model="nope", messages=USER)


def test_models_list(oai):
    ids = [m.id for m in oai.models.list()]
    assert ids == list(SCRIPTS)


# -- responses ---------------------------------------------------------------------------------


def test_responses_create_full(oai):
    response = oai.responses.create(
        model="full", input="hi", instructions="be brief", max_output_tokens=50
    )
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message", "function_call"]
    assert response.output_text == "Hello there, friend!"
    assert response.output[0].content[0].text == "let me think"
    call = response.output[2]
    assert (call.name, call.arguments, call.call_id) == (
        "get_weather",
        '{"city": "Paris"}',
        "call_0",
    )
    assert response.status == "completed"
    assert response.usage.input_tokens_details.cached_tokens == 2
    assert response.max_output_tokens == 50 and response.instructions == "be brief"


@pytest.fixture
def oai_lenient(server):
    """The SDK as clients run it by default (no strict validation): it takes stream events it
    has no type for, like the Open Responses ``response.reasoning.delta`` (OpenAI's name is
    ``response.reasoning_text.delta``), which a strict client refuses."""
    with openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0) as client:
        yield client


def test_responses_stream_events(oai_lenient):
    events = list(oai_lenient.responses.create(model="full", input="hi", stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[0].response.output == []
    assert events[1].type == "response.in_progress"
    assert events[-1].type == "response.completed"
    ids = {e.response.id for e in events if hasattr(e, "response")}
    assert len(ids) == 1
    types = [e.type for e in events]
    for expected in (
        "response.reasoning.delta",
        "response.reasoning.done",
        "response.output_text.delta",
        "response.output_text.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
    ):
        assert expected in types
    assert (
        types.count("response.output_item.added") == types.count("response.output_item.done") == 3
    )
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "let me think"
    assert final.usage.output_tokens == 5
    with oai_lenient.responses.stream(model="full", input="hi") as stream:
        helped = stream.get_final_response()
    assert helped.output_text == "Hello there, friend!" and helped.output[0].type == "reasoning"


def test_responses_stream_helper_final(oai):
    with oai.responses.stream(model="plain", input=[{"role": "user", "content": "hi"}]) as stream:
        final = stream.get_final_response()
    assert final.output_text == "Just text."


def test_responses_incomplete_on_max_output_tokens(oai):
    events = list(oai.responses.create(model="cut", input="hi", stream=True, max_output_tokens=3))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    response = oai.responses.create(model="cut", input="hi", max_output_tokens=3)
    assert response.status == "incomplete"


def test_responses_failure_events(oai):
    # The spec's error event nests its payload ({"type": "error", "error": {...}}), which the SDK
    # raises as an APIError carrying that payload (response.failed follows on the wire).
    stream = oai.responses.create(model="broken", input="hi", stream=True)
    got = []
    with pytest.raises(openai.APIError, match="worker died") as info:
        for event in stream:
            got.append(event.type)
    assert "response.output_text.delta" in got
    assert info.value.body == {
        "message": "worker died",
        "type": "server_error",
        "param": None,
        "code": "upstream",
    }


def test_responses_tool_round_trip_input(oai, server):
    upstream = ScriptedUpstream.of(*text_script("ok"))
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "use tool"}],
        },
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"city":"Oslo"}',
        },
        {"type": "function_call_output", "call_id": "c1", "output": "rainy"},
    ]
    from gateway.responses.wire import parse

    request, _ = parse({"model": "m", "input": items})
    roles = [m.role for m in request.messages]
    assert roles == ["user", "assistant", "tool"]
    assert request.messages[1].reasoning == "use tool"
    assert request.messages[1].tool_calls[0].name == "get_weather"
    assert request.messages[2].tool_call_id == "c1"
    assert upstream.calls == 0


# -- anthropic messages ------------------------------------------------------------------------


def test_messages_create_full(claude):
    message = claude.messages.create(model="full", max_tokens=20, messages=USER, system="be brief")
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[2].input == {"city": "Paris"}
    assert message.stop_reason == "tool_use"
    assert message.usage.cache_read_input_tokens == 2
    assert message.usage.input_tokens == 5


def test_messages_stream_events(claude):
    events = list(claude.messages.create(model="full", max_tokens=20, messages=USER, stream=True))
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    deltas = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert deltas == {"thinking_delta", "signature_delta", "text_delta", "input_json_delta"}
    assert types.count("content_block_start") == types.count("content_block_stop") == 3
    assert events[-2].delta.stop_reason == "tool_use"


def test_messages_stream_helper_final(claude):
    with claude.messages.stream(model="cut", max_tokens=3, messages=USER) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == "Cut short"
    assert final.stop_reason == "max_tokens"


def test_messages_midstream_error(claude):
    with pytest.raises(anthropic.APIStatusError, match="worker died"):
        for _ in claude.messages.create(model="broken", max_tokens=20, messages=USER, stream=True):
            pass


def test_messages_errors_in_anthropic_shape(claude):
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="nope", max_tokens=5, messages=USER)
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "not_found_error"


def test_messages_missing_max_tokens_is_400_naming_it(server):
    response = httpx.post(server.url + "/v1/messages", json={"model": "full", "messages": USER})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in response.json()["error"]["message"]


def test_messages_empty_answer(claude):
    message = claude.messages.create(model="empty", max_tokens=5, messages=USER)
    assert message.content == [] and message.stop_reason == "end_turn"


def test_messages_stop_sequence(claude):
    message = claude.messages.create(
        model="stopped", max_tokens=20, messages=USER, stop_sequences=["###"]
    )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "###")
    events = list(
        claude.messages.create(
            model="stopped", max_tokens=20, messages=USER, stop_sequences=["###"], stream=True
        )
    )
    assert (events[-2].delta.stop_reason, events[-2].delta.stop_sequence) == (
        "stop_sequence",
        "###",
    )
    with claude.messages.stream(
        model="stopped", max_tokens=20, messages=USER, stop_sequences=["###"]
    ) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "###")
    # Without a matched stop string it stays end_turn with a null stop_sequence.
    plain = claude.messages.create(model="plain", max_tokens=20, messages=USER)
    assert (plain.stop_reason, plain.stop_sequence) == ("end_turn", None)


def test_messages_start_reports_an_early_prompt_count(claude):
    events = list(claude.messages.create(model="counted", max_tokens=9, messages=USER, stream=True))
    assert events[0].type == "message_start"
    assert events[0].message.usage.input_tokens == 40
    assert (events[-2].usage.input_tokens, events[-2].usage.cache_read_input_tokens) == (10, 30)
    with claude.messages.stream(model="counted", max_tokens=9, messages=USER) as stream:
        final = stream.get_final_message()
    assert final.usage.input_tokens == 10 and final.usage.output_tokens == 3
    # Without an early count the start says 0 and the end has the real numbers.
    plain = list(claude.messages.create(model="plain", max_tokens=9, messages=USER, stream=True))
    assert plain[0].message.usage.input_tokens == 0 and plain[-2].usage.input_tokens == 5


def test_count_tokens_estimate(claude):
    count = claude.messages.count_tokens(model="full", messages=USER)
    assert count.input_tokens >= 1
