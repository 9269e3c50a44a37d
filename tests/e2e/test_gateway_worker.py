"""The gateway over the real worker (tiny MLX models, real HTTP on loopback): the three SDKs,
thinking, tool calls, usage with cached tokens, the sampling used, cancellation and an
unreachable worker."""

from __future__ import annotations

import anthropic
import openai
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.testing import ServerThread
from gateway.upstream import ModelInfo, StaticDirectory
from gateway.worker_client import WorkerClient
from worker.engine.core import Engine
from worker.serve.app import create_app as create_worker_app

USER = [{"role": "user", "content": "What is 2+2?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def gateway(tiny_model_dir, tiny_think_model_dir, tiny_tool_model_dir):
    engines, servers = [], []
    directory = StaticDirectory()
    try:
        for name, path, recommended in (
            ("plain", tiny_model_dir, None),
            ("think", tiny_think_model_dir, None),
            ("tool", tiny_tool_model_dir, None),
            ("sampled", tiny_model_dir, {"do_sample": True, "temperature": 0.7, "top_p": 0.8}),
        ):
            engine = Engine(str(path), name=name, generation_config_fallback=recommended)
            engine.start()
            engines.append(engine)
            server = ServerThread(create_worker_app(engine)).__enter__()
            servers.append(server)
            directory.add(ModelInfo(id=name), WorkerClient(server.url, name))
        directory.add(ModelInfo(id="down"), WorkerClient("http://127.0.0.1:9", "down"))
        app = create_app(directory, GatewayConfig(retry_backoff_ms=1))
        with ServerThread(app) as front:
            front.app = app
            front.worker_urls = {e.name: srv.url for e, srv in zip(engines, servers, strict=True)}
            yield front
    finally:
        for server in servers:
            server.__exit__(None, None, None)
        for engine in engines:
            engine.close()


@pytest.fixture
def oai(gateway):
    with openai.OpenAI(
        base_url=gateway.url + "/v1", api_key="k", _strict_response_validation=True, max_retries=0
    ) as c:
        yield c


@pytest.fixture
def claude(gateway):
    with anthropic.Anthropic(
        base_url=gateway.url, api_key="k", _strict_response_validation=True, max_retries=0
    ) as c:
        yield c


def test_chat_plain_runs_to_max_tokens(oai):
    completion = oai.chat.completions.create(model="plain", messages=USER, max_tokens=4)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 4 and completion.usage.prompt_tokens > 0
    chunks = list(
        oai.chat.completions.create(
            model="plain",
            messages=USER,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # same prompt again


def test_chat_thinking_on_and_off(oai):
    on = oai.chat.completions.create(model="think", messages=USER, max_tokens=20)
    message = on.choices[0].message
    assert message.model_extra["reasoning_content"].strip() == "Let me think"
    assert message.content.strip() == "The answer is 4."
    off = oai.chat.completions.create(
        model="think", messages=USER, max_tokens=20, reasoning_effort="none"
    )
    assert off.choices[0].message.content.strip() == "The answer is 4."
    assert not off.choices[0].message.model_extra.get("reasoning_content")


def test_chat_logprobs_streamed_and_not(oai):
    """Issue #44: the worker computed them and the gateway answered ``"logprobs": null``."""
    ask = {"model": "think", "messages": USER, "max_tokens": 20, "temperature": 0}
    ask |= {"reasoning_effort": "none", "logprobs": True, "top_logprobs": 3}
    whole = oai.chat.completions.create(**ask)
    entries = whole.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == whole.choices[0].message.content
    for e in entries:
        assert e.logprob <= 0 and e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token  # greedy
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True
        )
    chunks = list(oai.chat.completions.create(**ask, stream=True))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-3)
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [
        [t.token for t in e.top_logprobs] for e in entries
    ]
    plain = oai.chat.completions.create(**{**ask, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_a_cancelled_stream_logs_the_tokens_it_was_sent(gateway, oai):
    """Issue #44: the request log said ``completion_tokens: 1`` for a stream the client left
    after a hundred tokens (the early usage was all the gateway had been told)."""
    import time

    records: list = []
    gateway.app.state.gateway.metrics.listeners.append(records.append)
    try:
        stream = oai.chat.completions.create(
            model="plain", messages=USER, max_tokens=5000, temperature=0, stream=True
        )
        received = 0
        for chunk in stream:
            received += bool(chunk.choices and chunk.choices[0].delta.content)
            if received == 100:
                break
        stream.close()
        deadline = time.monotonic() + 10
        while not records:
            assert time.monotonic() < deadline, "no request log row"
            time.sleep(0.02)
    finally:
        gateway.app.state.gateway.metrics.listeners.remove(records.append)
    (record,) = records
    assert record.outcome == "cancelled"
    # At least what the client read; less than the 5000 asked for: it stopped there.
    assert 100 <= record.completion_tokens < 5000, record


def test_chat_tool_call(oai):
    with oai.chat.completions.stream(
        model="tool", messages=USER, tools=[WEATHER_TOOL], max_tokens=30
    ) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and '"Paris"' in call.function.arguments
    assert final.choices[0].finish_reason == "tool_calls"


def test_responses_thinking_and_tools(oai):
    response = oai.responses.create(model="think", input="2+2?", max_output_tokens=20)
    assert [i.type for i in response.output] == ["reasoning", "message"]
    assert response.output_text.strip() == "The answer is 4."
    tool_tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": WEATHER_TOOL["function"]["parameters"],
    }
    with oai.responses.stream(
        model="tool", input="weather?", tools=[tool_tool], max_output_tokens=30
    ) as stream:
        final = stream.get_final_response()
    assert [i.type for i in final.output] == ["function_call"]
    assert final.output[0].name == "get_weather"


def test_responses_report_the_sampling_used(oai):
    """``temperature``/``top_p`` are the numbers the worker used: the model's recommendation
    for what the request left out, the request's own values where it gave them."""
    default = oai.responses.create(model="sampled", input="hi", max_output_tokens=2)
    assert (default.temperature, default.top_p) == (0.7, 0.8)
    events = list(
        oai.responses.create(
            model="sampled", input="hi", max_output_tokens=2, temperature=0, stream=True
        )
    )
    final = events[-1].response  # response.incomplete: the junk model runs to the limit
    assert events[-1].type == "response.incomplete"
    assert (final.temperature, final.top_p) == (0.0, 0.8)


def test_messages_thinking_and_tools(claude):
    message = claude.messages.create(
        model="think",
        max_tokens=20,
        messages=USER,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert [b.type for b in message.content] == ["thinking", "text"]
    tools = [{"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}]
    with claude.messages.stream(model="tool", max_tokens=30, messages=USER, tools=tools) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert final.content[-1].type == "tool_use" and final.content[-1].input == {"city": "Paris"}


@pytest.mark.parametrize("stream", [False, True])
def test_messages_stop_sequence_from_the_worker(claude, stream):
    # The scripted "think" model answers "The answer is 4."; "answer" ends it.
    request = dict(
        model="think",
        max_tokens=20,
        messages=USER,
        stop_sequences=["zzz", "answer"],
        thinking={"type": "disabled"},
    )
    if stream:
        with claude.messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(**request)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "answer")
    assert message.content[0].text == "The "


def test_message_start_carries_the_prompt_size_and_its_cached_part(claude):
    """message_start has the real split (Claude Code reads it there): the second identical
    request's start already says how much of its prompt came from the cache."""
    messages = [{"role": "user", "content": "A prompt to see again: " + "words " * 20}]
    for _ in range(2):
        events = list(
            claude.messages.create(model="plain", max_tokens=4, messages=messages, stream=True)
        )
    start, end = events[0], events[-2]
    assert start.type == "message_start" and end.type == "message_delta"
    prompt = end.usage.input_tokens + (end.usage.cache_read_input_tokens or 0)
    assert prompt > 0 and end.usage.cache_read_input_tokens > 0
    started = start.message.usage
    assert started.input_tokens + (started.cache_read_input_tokens or 0) == prompt
    assert started.cache_read_input_tokens == end.usage.cache_read_input_tokens


def test_count_tokens_uses_worker_tokenizer(gateway):
    import httpx

    body = {"model": "plain", "messages": USER}
    response = httpx.post(gateway.url + "/v1/messages/count_tokens", json=body)
    assert response.headers["x-token-count"] == "exact" and response.json()["input_tokens"] > 0


def test_unreachable_worker_is_503_after_retry(oai):
    with pytest.raises(openai.InternalServerError) as info:
        oai.chat.completions.create(model="down", messages=USER, max_tokens=2)
    assert info.value.status_code == 503
    assert info.value.response.headers["x-attempts"] == "2"


def test_client_disconnect_stops_worker_generation(gateway, oai):
    import time

    import httpx

    # Greedy: the random model never favours <|im_end|>, so it runs to the length limit. Sampled
    # (the worker's default temperature is 1) it draws <|im_end|> after a few hundred tokens at
    # times, and the stream could end before /health is read.
    stream = oai.chat.completions.create(
        model="plain", messages=USER, max_tokens=5000, temperature=0, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    worker_health = gateway.worker_urls["plain"] + "/health"
    assert httpx.get(worker_health).json()["in_flight"] == 1  # still generating
    stream.close()
    deadline = time.monotonic() + 10
    while httpx.get(worker_health).json()["in_flight"] != 0:
        assert time.monotonic() < deadline, "the worker kept generating after the client left"
        time.sleep(0.05)
    usage = oai.chat.completions.create(model="plain", messages=USER, max_tokens=2).usage
    assert usage.completion_tokens == 2  # and it serves the next request
