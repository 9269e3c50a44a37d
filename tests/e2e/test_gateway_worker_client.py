"""WorkerClient without a worker: request bodies, chunk decoding and failure mapping over
httpx's MockTransport."""

from __future__ import annotations

import httpx
import orjson

from gateway.events import (
    Done,
    Error,
    Meta,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)
from gateway.request import ChatRequest, Message, ToolCall, ToolSpec
from gateway.worker_client import ChunkDecoder, WorkerClient, worker_body

REQUEST = ChatRequest(
    model="m",
    messages=[
        Message(role="user", content="hi"),
        Message(
            role="assistant",
            content="",
            reasoning="r",
            tool_calls=[ToolCall(id="c", name="f", arguments="{}")],
        ),
        Message(role="tool", content="42", tool_call_id="c"),
    ],
    tools=[ToolSpec(name="f")],
    max_tokens=9,
    reasoning=False,
    top_k=5,
    metadata={"logprobs": True},
)


def test_worker_body_carries_everything_the_worker_understands():
    body = worker_body(REQUEST, "served-name")
    assert body["model"] == "served-name" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["max_tokens"] == 9 and body["top_k"] == 5 and body["logprobs"] is True
    asked = REQUEST.model_copy(update={"metadata": {}, "logprobs": True, "top_logprobs": 3})
    assert (worker_body(asked, "m")["logprobs"], worker_body(asked, "m")["top_logprobs"]) == (
        True,
        3,
    )
    assert "logprobs" not in worker_body(REQUEST.model_copy(update={"metadata": {}}), "m")
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["messages"][1]["reasoning_content"] == "r"
    assert body["messages"][1]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert body["messages"][2]["tool_call_id"] == "c"
    assert body["tools"][0]["function"]["name"] == "f"
    explicit = REQUEST.model_copy(update={"chat_template_kwargs": {"enable_thinking": True}})
    assert worker_body(explicit, "m")["chat_template_kwargs"] == {"enable_thinking": True}


def _sse(*payloads: object) -> bytes:
    return b"".join(
        b"data: " + (p if isinstance(p, bytes) else orjson.dumps(p)) + b"\n\n" for p in payloads
    )


def _upstream(handler) -> WorkerClient:
    return WorkerClient(
        "http://worker", "m", client=httpx.AsyncClient(transport=httpx.MockTransport(handler))
    )


async def _events(upstream: WorkerClient) -> list:
    return [e async for e in upstream.stream(REQUEST)]


def _chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
    return {
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]
    }


async def test_chunks_become_events():
    body = _sse(
        _chunk({"role": "assistant", "reasoning_content": "hm"}),
        _chunk(
            {"content": "ok"},
            logprobs={"content": [{"token": "ok", "logprob": -0.5, "top_logprobs": []}]},
        ),
        _chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": ""},
                    }
                ]
            }
        ),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
        _chunk({}, "tool_calls"),
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 10,
                "completion_tokens": 4,
                "prompt_tokens_details": {"cached_tokens": 6},
            },
        },
        b"[DONE]",
    )
    events = await _events(_upstream(lambda request: httpx.Response(200, content=body)))
    assert events == [
        ReasoningDelta("hm"),
        TextDelta("ok", logprobs=(TokenLogprob("ok", -0.5),)),
        ToolCallDelta(0, id="c1", name="f", arguments=""),
        ToolCallDelta(0, arguments="{}"),
        Usage(10, 4, 6),
        Done("tool_calls"),
    ]


async def test_a_shortened_tool_listing_becomes_a_route_header():
    body = _sse(_chunk({"content": "ok"}, "stop"), b"[DONE]")
    headers = {"x-tools-listing": "names"}
    upstream = _upstream(lambda request: httpx.Response(200, content=body, headers=headers))
    assert (await _events(upstream))[:2] == [Meta({"x-tools-listing": "names"}), TextDelta("ok")]
    plain = await _events(_upstream(lambda request: httpx.Response(200, content=body)))
    assert not any(isinstance(e, Meta) for e in plain)


async def test_continuous_usage_gives_an_early_usage_then_each_new_count_after_its_deltas():
    def counted(chunk: dict, completion: int) -> dict:
        return {**chunk, "usage": {"prompt_tokens": 10, "completion_tokens": completion}}

    body = _sse(
        counted(_chunk({"role": "assistant", "content": "a"}), 1),
        counted(_chunk({"content": "b"}), 2),
        counted(_chunk({}, "stop"), 2),
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 10,
                "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 4},
            },
        },
        b"[DONE]",
    )
    events = await _events(_upstream(lambda request: httpx.Response(200, content=body)))
    assert events == [
        Usage(10, 1),
        TextDelta("a"),
        TextDelta("b"),
        Usage(10, 2),  # what a stream cut off here has cost: the request log counts it
        Usage(10, 2, 4),
        Done("stop"),
    ]


def test_a_stream_cut_off_mid_answer_has_told_its_token_count():
    """The request log of a stream the client left after 100 tokens counts 100, not the 1 of
    the early usage (issue #44): each chunk's count follows its text."""
    decoder = ChunkDecoder()
    seen: list = []
    for n in range(1, 101):
        chunk = _chunk({"content": f"t{n} "})
        chunk["usage"] = {"prompt_tokens": 7, "completion_tokens": n}
        seen += decoder.decode(chunk)
    usages = [e for e in seen if isinstance(e, Usage)]
    assert usages[0] == Usage(7, 1) and seen.index(usages[0]) == 0  # the early one, first
    assert usages[-1] == Usage(7, 100) and seen[-1] == usages[-1]  # after the last text
    # An answer the client waits for whole is never sent cut off: the early count is enough.
    whole = ChunkDecoder(running_count=False)
    chunks = [_chunk({"content": "a"}), _chunk({"content": "b"})]
    for n, chunk in enumerate(chunks, start=1):
        chunk["usage"] = {"prompt_tokens": 7, "completion_tokens": n}
    events = [e for chunk in chunks for e in whole.decode(chunk)] + whole.finish()
    assert events == [Usage(7, 1), TextDelta("a"), TextDelta("b"), Usage(7, 2), Done("stop")]


async def test_logprobs_become_token_entries_of_the_text_delta():
    entry = {
        "token": "ok",
        "logprob": -0.5,
        "bytes": [111, 107],
        "top_logprobs": [
            {"token": "ok", "logprob": -0.5, "bytes": [111, 107]},
            {"token": "no", "logprob": -1.5, "bytes": [110, 111]},
        ],
    }
    second = {"token": "!", "logprob": -1.5, "top_logprobs": []}
    body = _sse(
        _chunk({"content": "ok!"}, logprobs={"content": [entry, second], "refusal": None}),
        _chunk({}, "stop"),
        b"[DONE]",
    )
    events = await _events(_upstream(lambda request: httpx.Response(200, content=body)))
    top = (TokenLogprob("ok", -0.5), TokenLogprob("no", -1.5))
    expected = (TokenLogprob("ok", -0.5, top), TokenLogprob("!", -1.5))
    assert events[0] == TextDelta("ok!", logprob=-1.0, logprobs=expected)
    # The mean is set with the entries (MoA scores by it; the tunnel keeps such a delta whole).
    assert TextDelta("ok!", logprobs=expected).logprob == -1.0


async def test_matched_stop_string_reaches_done():
    def final(choice_extra: dict, finish: str = "stop") -> bytes:
        chunk = _chunk({}, finish)
        chunk["choices"][0].update(choice_extra)
        return _sse(_chunk({"content": "a"}), chunk, b"[DONE]")

    async def done_of(body: bytes) -> Done:
        events = await _events(_upstream(lambda r: httpx.Response(200, content=body)))
        return events[-1]

    assert await done_of(final({"stop_reason": "###"})) == Done("stop", stop_sequence="###")
    assert await done_of(final({"stop_reason": None})) == Done("stop")
    assert await done_of(final({})) == Done("stop")
    # vLLM reports a stop *token* as its id: that is no stop string.
    assert await done_of(final({"stop_reason": 7})) == Done("stop")
    assert await done_of(final({"stop_reason": "###"}, "length")) == Done("length")


async def test_status_errors_map_to_kinds():
    busy = await _events(
        _upstream(lambda r: httpx.Response(503, json={"error": {"message": "full"}}))
    )
    assert busy == [Error(kind="unavailable", message="full", retryable=True)]
    long = {
        "error": {
            "message": "too long",
            "type": "invalid_request_error",
            "code": "context_length_exceeded",
        }
    }
    (error,) = await _events(_upstream(lambda r: httpx.Response(400, json=long)))
    assert (error.kind, error.code, error.retryable) == (
        "invalid_request",
        "context_length_exceeded",
        False,
    )


async def test_midstream_error_and_early_close():
    failed = _sse(
        _chunk({"content": "a"}),
        {"error": {"message": "oom", "type": "server_error", "code": None}},
        b"[DONE]",
    )
    events = await _events(_upstream(lambda r: httpx.Response(200, content=failed)))
    assert events[-1] == Error(kind="upstream", message="oom")
    cut_after_content = await _events(
        _upstream(lambda r: httpx.Response(200, content=_sse(_chunk({"content": "a"}))))
    )
    assert cut_after_content[-1].kind == "upstream" and not cut_after_content[-1].retryable
    cut_before = await _events(_upstream(lambda r: httpx.Response(200, content=b"")))
    assert cut_before == [  # the worker went away before answering: 503, retryable
        Error(
            kind="unavailable", message="the worker closed the stream before [DONE]", retryable=True
        )
    ]


async def test_refused_connection_is_retryable_unavailable():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    (error,) = await _events(_upstream(refuse))
    assert error.kind == "unavailable" and error.retryable
