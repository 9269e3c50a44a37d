"""The worker's HTTP app over real uvicorn on loopback, driven by the openai SDK and httpx."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from worker.chat.prompt import ChatTemplate
from worker.convert.tokenizer import FALLBACK_CHAT_TEMPLATE
from worker.engine.core import Engine
from worker.engine.types import EngineConfig
from worker.serve.app import create_app
from worker.testing import PrefillSpy, make_tiny_model, run_worker_in_thread
from worker.testing import wait_until as async_wait_until


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> Iterator[tuple[str, Engine]]:
    with run_worker_in_thread(tiny_model_dir, name="tiny") as served:
        yield served


@pytest.fixture(scope="module")
def think(tiny_think_model_dir: Path) -> Iterator[tuple[str, Engine]]:
    with run_worker_in_thread(tiny_think_model_dir, name="tiny-think") as served:
        yield served


@pytest.fixture(scope="module")
def tool(tiny_tool_model_dir: Path) -> Iterator[tuple[str, Engine]]:
    with run_worker_in_thread(tiny_tool_model_dir, name="tiny-tool") as served:
        yield served


def client(served: tuple[str, Engine]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0], api_key="unused", max_retries=0, timeout=60)


def wait_until(predicate: Callable[[], bool], limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


HI = [{"role": "user", "content": "Hi"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_non_stream_with_thinking_split(think: tuple[str, Engine]) -> None:
    reply = client(think).chat.completions.create(model="tiny-think", messages=HI, temperature=0)
    message = reply.choices[0].message
    assert message.content == "The answer is 4."
    assert message.model_extra["reasoning_content"] == "Let me think"
    assert reply.choices[0].finish_reason == "stop"
    usage = reply.usage
    assert usage.completion_tokens == 11  # 10 script tokens + <|im_end|>
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_stream_with_thinking_split_and_usage(think: tuple[str, Engine]) -> None:
    stream = client(think).chat.completions.create(
        model="tiny-think",
        messages=[{"role": "user", "content": "Stream please"}],
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == ["assistant"]
    assert chunks[0].choices[0].delta.role == "assistant"
    reasoning = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        for c in chunks
        if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == ("Let me think", "The answer is 4.")
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 11
    assert all(c.usage is None for c in chunks[:-1])  # only the usage chunk, unless asked


def test_continuous_usage_reports_the_prompt_from_the_first_chunk(
    think: tuple[str, Engine],
) -> None:
    chunks = list(
        client(think).chat.completions.create(
            model="tiny-think",
            messages=HI,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    final = chunks[-1].usage
    assert chunks[-1].choices == [] and final.completion_tokens == 11
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert all(c.usage.prompt_tokens == final.prompt_tokens for c in chunks[:-1])
    assert counts == sorted(counts) and 1 <= counts[0] and counts[-1] == 11
    assert all(
        c.usage.total_tokens == final.prompt_tokens + n
        for c, n in zip(chunks[:-1], counts, strict=True)
    )


@pytest.mark.parametrize(
    "knob",
    [
        {"reasoning_effort": "none"},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"thinking": {"type": "disabled"}},
        {"enable_thinking": False},
    ],
)
def test_thinking_off_knobs(think: tuple[str, Engine], knob: dict[str, Any]) -> None:
    reply = client(think).chat.completions.create(
        model="tiny-think", messages=HI, temperature=0, extra_body=knob
    )
    message = reply.choices[0].message
    assert message.content == "The answer is 4."
    assert "reasoning_content" not in (message.model_extra or {})


def test_tool_calls_non_stream_and_stream(tool: tuple[str, Engine]) -> None:
    api = client(tool)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = api.chat.completions.create(
        model="tiny-tool", messages=messages, tools=[WEATHER_TOOL], temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")

    chunks = list(
        api.chat.completions.create(
            model="tiny-tool", messages=messages, tools=[WEATHER_TOOL], temperature=0, stream=True
        )
    )
    fragments = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert fragments[0].id and fragments[0].function.name == "get_weather"
    # The arguments follow the opening fragment as they are generated, without id or name.
    assert fragments[0].function.arguments == "" and len(fragments) >= 2
    assert all(f.id is None and f.function.name is None for f in fragments[1:])
    assert {f.index for f in fragments} == {0}
    # Cut before its end tag: the call was already streamed, and the finish says it is cut.
    cut = api.chat.completions.create(
        model="tiny-tool", messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=2
    )
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert json.loads("".join(f.function.arguments or "" for f in fragments)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # The call goes back into the conversation (assistant tool_calls + tool result).
    follow = api.chat.completions.create(
        model="tiny-tool",
        temperature=0,
        tools=[WEATHER_TOOL],
        messages=[
            *messages,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ],
    )
    assert follow.choices[0].finish_reason in ("tool_calls", "stop", "length")


@pytest.mark.parametrize("extra", [{}, {"tools": [WEATHER_TOOL], "tool_choice": "none"}])
def test_without_tools_tool_text_stays_content(
    tool: tuple[str, Engine], extra: dict[str, Any]
) -> None:
    reply = client(tool).chat.completions.create(
        model="tiny-tool", messages=HI, temperature=0, **extra
    )
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content.startswith("<tool_call>")
    assert reply.choices[0].finish_reason == "stop"


def test_max_tokens_and_stop(plain: tuple[str, Engine], think: tuple[str, Engine]) -> None:
    reply = client(plain).chat.completions.create(
        model="tiny", messages=HI, temperature=0, max_tokens=5
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5
    reply = client(think).chat.completions.create(
        model="tiny-think", messages=HI, temperature=0, stop=["answer"], reasoning_effort="none"
    )
    assert reply.choices[0].message.content == "The "
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].model_extra["stop_reason"] == "answer"
    chunks = list(
        client(think).chat.completions.create(
            model="tiny-think",
            messages=HI,
            temperature=0,
            stop=["zzz", "answer"],
            reasoning_effort="none",
            stream=True,
        )
    )
    final = chunks[-1].choices[0]
    assert (final.finish_reason, final.model_extra["stop_reason"]) == ("stop", "answer")
    assert all(c.choices[0].model_extra.get("stop_reason") is None for c in chunks[:-1])
    reply = client(think).chat.completions.create(
        model="tiny-think", messages=HI, temperature=0, reasoning_effort="none"
    )
    assert (reply.choices[0].finish_reason, reply.choices[0].model_extra["stop_reason"]) == (
        "stop",
        None,
    )


def test_seeded_determinism(plain: tuple[str, Engine]) -> None:
    def sample(seed: int) -> str:
        reply = client(plain).chat.completions.create(
            model="tiny", messages=HI, temperature=1.0, seed=seed, max_tokens=16
        )
        return reply.choices[0].message.content

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_logprobs_in_stream(think: tuple[str, Engine]) -> None:
    chunks = list(
        client(think).chat.completions.create(
            model="tiny-think",
            messages=HI,
            temperature=0,
            stream=True,
            logprobs=True,
            top_logprobs=2,
            reasoning_effort="none",
        )
    )
    entries = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert "".join(e.token for e in entries) == "The answer is 4."
    assert all(e.logprob <= 0 for e in entries)
    # OpenAI's shape: each token's bytes, and its position's likeliest tokens (greedy: its own
    # first).
    assert all(e.bytes == list(e.token.encode()) for e in entries)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in entries)
    with pytest.raises(openai.BadRequestError) as info:
        client(think).chat.completions.create(model="tiny-think", messages=HI, top_logprobs=2)
    assert info.value.body["param"] == "top_logprobs"


async def test_eight_concurrent_streams(plain: tuple[str, Engine]) -> None:
    api = openai.AsyncOpenAI(base_url=plain[0], api_key="unused", max_retries=0, timeout=60)

    async def one(i: int) -> tuple[str, int]:
        stream = await api.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"request {i}"}],
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, usage

    try:
        results = await asyncio.gather(*(one(i) for i in range(8)))
    finally:
        await api.close()
    assert [usage for _, usage in results] == [12] * 8
    assert all(text for text, _ in results)


def test_disconnect_cancels_generation(plain: tuple[str, Engine]) -> None:
    url, engine = plain
    before = engine.stats.cancelled
    body = {"messages": HI, "max_tokens": 3000, "temperature": 0, "stream": True}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{url}/chat/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        received = [line for _, line in zip(range(6), lines, strict=False) if line]
        assert received[0].startswith("data: ")
    wait_until(lambda: engine.stats.cancelled == before + 1 and engine.stats.in_flight == 0)
    generated = engine.stats.generated_tokens
    time.sleep(0.2)
    assert engine.stats.generated_tokens == generated
    assert "cancelled" in [kind for kind, _ in list(engine.stats.events)[-5:]]


def test_second_turn_reports_cached_tokens(tool: tuple[str, Engine]) -> None:
    api = client(tool)
    messages = [{"role": "user", "content": "A question that starts a conversation"}]
    first = api.chat.completions.create(model="tiny-tool", messages=messages, temperature=0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "and a follow-up"},
    ]
    chunks = list(
        api.chat.completions.create(
            model="tiny-tool",
            messages=messages,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def test_client_never_waits_for_the_commit(think: tuple[str, Engine]) -> None:
    _, engine = think
    release = threading.Event()
    engine.before_commit = lambda _job_id: release.wait(120)
    commits = engine.stats.commits
    try:
        chunks = list(
            client(think).chat.completions.create(
                model="tiny-think", messages=[{"role": "user", "content": "x"}], stream=True
            )
        )
        # The whole response arrived while the commit could not land yet.
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert engine.stats.commits == commits
    finally:
        release.set()
        engine.before_commit = None
    wait_until(lambda: engine.stats.commits == commits + 1)


@pytest.mark.parametrize("stream", [True, False])
async def test_commit_is_requested_after_the_terminal_frame(
    tiny_think_model_dir: Path, stream: bool
) -> None:
    engine = Engine(str(tiny_think_model_dir), name="m")
    engine.start(timeout=60)
    order: list[str] = []
    real_commit = engine.commit

    def commit(job: Any, next_turn: list[int] | None = None) -> None:
        order.append("commit")
        real_commit(job, next_turn)

    engine.commit = commit  # type: ignore[method-assign]
    app = create_app(engine)
    body = json.dumps({"messages": HI, "stream": stream, "temperature": 0}).encode()
    inbox = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if inbox:
            return inbox.pop()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            data = message.get("body", b"")
            if b"[DONE]" in data or (not stream and data):
                order.append("terminal")

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "scheme": "http",
        "root_path": "",
    }
    try:
        await asyncio.wait_for(app(scope, receive, send), 60)
        # A stream's commit is requested from a task of its own once the next turn rendered.
        await async_wait_until(lambda: "commit" in order)
    finally:
        engine.close()
    assert order == ["terminal", "commit"]


def post(url: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}/chat/completions", content=content, timeout=60)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": []}, "messages"),
        ({}, "messages"),
        ({"messages": HI, "temperature": 5}, "temperature"),
        ({"messages": HI, "max_tokens": 0}, "max_tokens"),
        ({"messages": HI, "stop": 3}, "stop"),
        ({"messages": HI, "logit_bias": {"99999": 1}}, "logit_bias"),
    ],
)
def test_bad_requests_name_the_field(plain: tuple[str, Engine], body: Any, param: str) -> None:
    response = post(plain[0], body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param or error["param"].startswith(param)
    assert param.split(".")[0] in error["message"]


def test_malformed_json_unknown_model_and_still_serving(plain: tuple[str, Engine]) -> None:
    url, _ = plain
    for raw in (b"{not json", b"[1, 2]", b""):
        response = post(url, raw)
        assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    response = post(url, {"model": "no-such-model", "messages": HI})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    ok = post(url, {"model": "tiny", "messages": HI, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_context_length_exceeded(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "short", max_position_embeddings=64)
    with run_worker_in_thread(model, name="short") as (url, _):
        long = [{"role": "user", "content": "hello world " * 100}]
        response = post(url, {"messages": long})
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
        # Anthropic's words, which Claude Code parses to compact and retry.
        assert re.match(
            r"prompt is too long: \d+ tokens > 64 maximum", response.json()["error"]["message"]
        )
        # max_tokens is clamped to what the context leaves; the server keeps serving.
        ok = post(url, {"messages": HI, "max_tokens": 1000, "temperature": 0})
        assert ok.status_code == 200
        usage = ok.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] <= 64


def test_health_and_models(plain: tuple[str, Engine]) -> None:
    url, _ = plain
    base = url.removesuffix("/v1")
    health = httpx.get(f"{base}/health").json()
    assert health["status"] == "ok" and health["model"] == "tiny"
    assert {"queue_depth", "in_flight", "tokens_per_second", "uptime_s"} <= health.keys()
    assert isinstance(health["tokens_per_second"], float)
    models = httpx.get(f"{url}/models").json()
    (entry,) = models["data"]
    assert entry["id"] == "tiny" and entry["owned_by"] == "mlx-mesh"
    assert entry["architecture"] == "llama" and entry["context_length"] == 4096
    assert entry["parameters"] > 0 and entry["quantization"]


def test_health_counts_speculation(plain: tuple[str, Engine]) -> None:
    """Random weights loop under greedy decoding: prompt lookup drafts the loop and the verify
    passes accept it; /health says how much and how many tokens a pass gave."""
    url, _ = plain
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 60, "temperature": 0}
    assert post(url, body).status_code == 200
    speculation = httpx.get(f"{url.removesuffix('/v1')}/health").json()["speculation"]
    assert speculation["mode"] == "auto" and speculation["draft"] == "prompt lookup"
    assert speculation["accepted"] > 0 and speculation["drafted"] >= speculation["accepted"]
    assert 0 < speculation["acceptance_rate"] <= 1
    assert speculation["tokens_per_step"] > 1


@pytest.fixture(scope="module")
def recommending(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The tiny model with a generation_config.json that recommends sampling."""
    model = tmp_path_factory.mktemp("recommending") / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20})
    )
    with run_worker_in_thread(model, name="tiny-rec") as served:
        yield served


def test_omitted_sampling_fields_get_the_models_recommendation(recommending) -> None:
    url, _ = recommending
    body = {"model": "tiny-rec", "messages": HI, "max_tokens": 2}
    reply = httpx.post(f"{url}/chat/completions", json=body, timeout=60).json()
    assert reply["sampling"] == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
    (entry,) = httpx.get(f"{url}/models").json()["data"]
    assert entry["sampling_defaults"]["source"] == "generation_config.json"
    assert entry["sampling_defaults"]["temperature"] == 0.6


def test_a_request_value_wins_over_the_recommendation(recommending) -> None:
    url, _ = recommending
    body = {
        "model": "tiny-rec",
        "messages": HI,
        "max_tokens": 2,
        "temperature": 0,
        "top_k": 0,  # explicit "off" is a value too
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=60) as response:
        chunks = [
            json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")
        ]
    finishing = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["sampling"] for c in finishing] == [
        {"temperature": 0.0, "top_p": 0.95, "top_k": 0, "min_p": 0.0}
    ]
    assert all("sampling" not in c for c in chunks if c not in finishing)


def test_min_temperature_floors_the_recommended_temperature_only(recommending) -> None:
    # model=mesh's vote samples ask for the model's own sampling, but never colder than 0.8.
    url, _ = recommending
    sampling = []
    for extra in (
        {"min_temperature": 0.8},
        {"min_temperature": 0.3},
        {"min_temperature": 0.8, "temperature": 0.1},
    ):
        body = {"model": "tiny-rec", "messages": HI, "max_tokens": 2, **extra}
        reply = httpx.post(f"{url}/chat/completions", json=body, timeout=60).json()
        sampling.append(reply["sampling"]["temperature"])
    assert sampling == [0.8, 0.6, 0.1]


def test_penalties_change_greedy_output(plain: tuple[str, Engine]) -> None:
    def greedy(**extra: Any) -> str:
        reply = client(plain).chat.completions.create(
            model="tiny", messages=HI, temperature=0, max_tokens=40, **extra
        )
        return reply.choices[0].message.content

    base = greedy()
    assert greedy() == base
    assert greedy(frequency_penalty=2.0) != base
    assert greedy(presence_penalty=2.0) != base
    assert greedy(extra_body={"repetition_penalty": 1.8}) != base


def test_mid_stream_failure_ends_with_an_error_frame(tiny_model_dir: Path) -> None:
    with run_worker_in_thread(tiny_model_dir, name="fragile") as (url, engine):
        real_next = engine._rows.generator.next
        calls = {"n": 0}

        def failing_next() -> Any:
            calls["n"] += 1
            if calls["n"] == 4:
                raise RuntimeError("simulated accelerator fault")
            return real_next()

        engine._rows.generator.next = failing_next
        body = {"messages": HI, "max_tokens": 50, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=60) as response:
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert "simulated accelerator fault" in error["message"]
        assert error["type"] and error["code"]
        # The engine recovered: the next request is served normally.
        ok = post(url, {"messages": HI, "max_tokens": 3, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert engine.stats.in_flight == 0 and engine.stats.queue_depth == 0


def test_non_stream_disconnect_cancels_generation(plain: tuple[str, Engine]) -> None:
    url, engine = plain
    before = engine.stats.cancelled
    body = {"messages": HI, "max_tokens": 4000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/chat/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    wait_until(lambda: engine.stats.cancelled == before + 1 and engine.stats.in_flight == 0)
    last = [kind for kind, _ in engine.stats.events][-1]
    assert last == "cancelled"


def test_a_worker_with_a_secret_serves_only_who_knows_it(tiny_model_dir) -> None:
    import httpx

    from worker.testing import run_worker_in_thread

    with run_worker_in_thread(tiny_model_dir, name="tiny", secret="s3cret") as (url, _engine):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            refused = httpx.post(f"{url}/chat/completions", json=body, headers=headers)
            assert refused.status_code == 401
            assert refused.json()["error"]["type"] == "authentication_error"
        ok = httpx.post(
            f"{url}/chat/completions", json=body, headers={"authorization": "Bearer s3cret"}
        )
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


_TOOLLESS_TEMPLATE = (  # like SmolLM2's: drops tools and tool calls without a word
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def toolless(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The tiny model with a chat template that cannot render tools."""
    model = tmp_path_factory.mktemp("toolless") / "model"
    shutil.copytree(tiny_model_dir, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = _TOOLLESS_TEMPLATE
    config_path.write_text(json.dumps(config))
    with run_worker_in_thread(model, name="tiny-toolless") as served:
        yield served


def test_a_template_without_tools_gets_the_generic_tool_prompt(toolless, plain) -> None:
    url, engine = toolless
    (entry,) = httpx.get(f"{url}/models").json()["data"]
    capabilities = entry["capabilities"]
    assert (capabilities["tools"], capabilities["context_length"]) == ("generic", 4096)
    (native,) = httpx.get(f"{plain[0]}/models").json()["data"]
    assert native["capabilities"]["tools"] == "native"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    tokens, _ = ChatTemplate(engine.tokenizer).render(messages, [tool], {})
    text = engine.tokenizer.decode(tokens)
    assert "# Tools" in text and '"name": "get_weather"' in text
    assert "<tool_call>" in text and "<tool_response>\nsunny\n</tool_response>" in text
    body = {"model": "tiny-toolless", "messages": messages[:1], "tools": [tool], "max_tokens": 2}
    with_tools = httpx.post(f"{url}/chat/completions", json=body, timeout=60).json()
    body.pop("tools")
    without = httpx.post(f"{url}/chat/completions", json=body, timeout=60).json()
    assert with_tools["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"] + 50


def _verbose_tools(count: int) -> list[dict[str, Any]]:
    """An agent harness's tools: each with a manual of a description (Claude Code's are
    ~800 tokens a tool)."""
    manual = "Use it with care and read the whole manual first. " * 60
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"Does job number {i}. {manual}",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "description": manual}},
                    "required": ["path"],
                },
            },
        }
        for i in range(count)
    ]


@pytest.mark.parametrize("fixture", ["toolless", "plain"])
def test_tools_that_cannot_fit_the_context_are_listed_shorter(fixture, request) -> None:
    """Issue 13: Claude Code's tools alone are ~20,000 tokens, more than SmolLM2's context.
    The worker lists them briefer until a quarter of the context is left, says so in a header,
    and the tools stay callable by name (generic prompt and native template alike)."""
    url, engine = request.getfixturevalue(fixture)
    tools = _verbose_tools(12)
    messages = [{"role": "user", "content": "List the files."}]
    full, _ = ChatTemplate(engine.tokenizer).render(messages, tools, {})
    assert len(full) > engine.info.context_length  # it could not be served as sent
    body = {"messages": messages, "tools": tools, "max_tokens": 2, "temperature": 0}
    for stream in (False, True):
        with httpx.stream(
            "POST", f"{url}/chat/completions", json=body | {"stream": stream}, timeout=60
        ) as response:
            response.read()
        assert response.status_code == 200, response.text
        assert response.headers["x-tools-listing"] in ("brief", "names")
    listing = response.headers["x-tools-listing"]
    shown, _ = ChatTemplate(engine.tokenizer).render(messages, tools, {}, listing)
    assert len(shown) <= engine.info.context_length * 3 // 4
    text = engine.tokenizer.decode(shown)
    assert all(f"tool_{i}" in text for i in range(12)) and "read the whole manual" not in text
    short = [{"type": "function", "function": {"name": "ls", "description": "Lists files."}}]
    few = httpx.post(f"{url}/chat/completions", json=body | {"tools": short}, timeout=60)
    assert few.status_code == 200 and "x-tools-listing" not in few.headers


@pytest.mark.parametrize("span", [32, 0])
def test_an_answer_stuck_in_a_loop_ends_as_stopped(tiny_model_dir: Path, span: int) -> None:
    """SmolLM2 at 0.2 repeats one sentence until max_tokens (32,000 from Claude Code): the loop
    guard ends it once the last ``span`` tokens are one block repeated; 0 turns it off."""
    config = EngineConfig(loop_guard_tokens=span)
    with run_worker_in_thread(tiny_model_dir, name="tiny", config=config) as (url, engine):
        token = engine.tokenizer.encode("a", add_special_tokens=False)[0]
        body = {
            "messages": [{"role": "user", "content": "Say a."}],
            "max_tokens": 80,
            "logit_bias": {str(token): 100},  # the same token every step: a loop of one
            "temperature": 0,
        }
        answer = httpx.post(f"{url}/chat/completions", json=body, timeout=60).json()
        health = httpx.get(f"{url.removesuffix('/v1')}/health").json()
    if span:
        assert answer["choices"][0]["finish_reason"] == "stop"
        assert answer["usage"]["completion_tokens"] == span
        assert health["loops_stopped"] == 1
    else:
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 80
        assert health["loops_stopped"] == 0


def test_a_client_that_leaves_during_a_long_prefill_stops_it_and_its_retry_resumes(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 13: an agent that times out on a long cold prefill and retries. The disconnect
    stops the prefill after the chunk under way, and the retry starts from the chunks done."""
    step = 16
    config = EngineConfig(prefill_step_size=step)
    text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(40))
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 3, "temperature": 0}
    with run_worker_in_thread(tiny_model_dir, name="tiny", config=config) as (url, engine):
        spy = PrefillSpy.install(engine)
        leave, cancelled = threading.Event(), threading.Event()
        real_cancel = engine.cancel

        def cancel(job: Any) -> None:
            real_cancel(job)
            cancelled.set()

        def on_chunk(n: int) -> None:
            if n == 3:
                leave.set()
                # The engine goes on only once the disconnect reached it: what it does next is
                # what it does between chunks, however slowly the disconnect travelled.
                assert cancelled.wait(30)

        monkeypatch.setattr(engine, "cancel", cancel)
        spy.on_chunk = on_chunk
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", f"{url}/chat/completions", json=body | {"stream": True}) as r,
        ):
            assert r.status_code == 200
            assert leave.wait(30)  # no content yet: the client gives up (Claude Code's 300 s)
        wait_until(lambda: engine.stats.cancelled == 1 and engine.stats.queue_depth == 0)
        assert spy.chunks == [step] * 3
        spy.reset()
        retry = httpx.post(f"{url}/chat/completions", json=body, timeout=60).json()
        assert retry["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * step
        assert sum(spy.chunks) == retry["usage"]["prompt_tokens"] - 1 - 3 * step


def test_a_model_without_a_chat_template_says_so(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A base model continues text instead of answering turns: ``mesh`` leaves it out
    (gateway.moa.candidates.follows_chat) when another model is there."""
    import httpx

    model = tmp_path / "base"
    shutil.copytree(tiny_model_dir, model)
    for extra in model.glob("chat_template*"):
        extra.unlink()
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    with run_worker_in_thread(model, name="tiny-base") as (url, _engine):
        (entry,) = httpx.get(f"{url}/models").json()["data"]
        assert entry["capabilities"]["chat_template"] is False
    with run_worker_in_thread(tiny_model_dir, name="tiny") as (url, _engine):
        (entry,) = httpx.get(f"{url}/models").json()["data"]
        assert entry["capabilities"]["chat_template"] is True
    # A GGUF without one (gemma3-270m) is converted with a stand-in template: still none.
    config["chat_template"] = "{{ bos_token }}" + FALLBACK_CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    with run_worker_in_thread(model, name="tiny-converted-base") as (url, _engine):
        (entry,) = httpx.get(f"{url}/models").json()["data"]
        assert entry["capabilities"]["chat_template"] is False
