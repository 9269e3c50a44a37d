"""Chat ``logprobs``/``top_logprobs`` (issue #44): each answer token with its log-probability and
its position's likeliest tokens, in OpenAI's shape, streamed and not, one list per choice; the
refusals (``top_logprobs`` alone, ``model="mesh"``) are 400s naming the field."""

from __future__ import annotations

import openai._models as openai_models
import orjson
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gateway.answer import Accumulator
from gateway.api import chat
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.events import ChoiceEvent, Done, ReasoningDelta, TextDelta, TokenLogprob, Usage
from gateway.refusals import RequestInvalid
from gateway.testing import ScriptedUpstream, asgi_request
from gateway.upstream import ModelInfo, StaticDirectory

USER = [{"role": "user", "content": "hi"}]


def _entry(token: str, logprob: float, *top: tuple[str, float]) -> TokenLogprob:
    return TokenLogprob(token, logprob, tuple(TokenLogprob(t, lp) for t, lp in top))


HELLO = _entry("Hel", -0.25, ("Hel", -0.25), ("Hi", -1.5))
LO = _entry("lo é", -0.5, ("lo é", -0.5), ("p", -2.0))
ANSWER = [ReasoningDelta("hm"), TextDelta("Hel", logprobs=(HELLO,)), TextDelta("lo é", logprobs=(LO,))]  # fmt: skip
END = [Usage(3, 2), Done("stop")]


def _wire(entry: TokenLogprob) -> dict:
    def one(e: TokenLogprob) -> dict:
        return {"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode())}

    return one(entry) | {"top_logprobs": [one(t) for t in entry.top_logprobs]}


def test_logprobs_and_top_logprobs_reach_the_request() -> None:
    request, _ = chat.parse({"model": "m", "messages": USER, "logprobs": True, "top_logprobs": 2})
    assert (request.logprobs, request.top_logprobs) == (True, 2)
    plain, _ = chat.parse({"model": "m", "messages": USER})
    assert (plain.logprobs, plain.top_logprobs) == (False, None)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),  # OpenAI: top_logprobs needs logprobs: true
        ({"logprobs": False, "top_logprobs": 1}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": True, "model": "mesh"}, "logprobs"),  # no one model's distribution
    ],
)
def test_logprob_mistakes_are_400s_naming_the_field(extra: dict, param: str) -> None:
    with pytest.raises(RequestInvalid) as info:
        chat.parse({"model": "m", "messages": USER, **extra})
    assert info.value.param == param


def test_mesh_without_logprobs_is_served() -> None:
    request, _ = chat.parse({"model": "mesh", "messages": USER, "logprobs": False})
    assert not request.logprobs


def _chunks(body: dict, events: list) -> list[ChatCompletionChunk]:
    request, parsed = chat.parse(body)
    encoder = chat.ChatStreamEncoder(request, parsed)
    raw = b"".join(encoder.encode(e) for e in events).decode()
    payloads = [orjson.loads(b[6:]) for b in raw.split("\n\n") if b.startswith("data: {")]
    return [openai_models.validate_type(type_=ChatCompletionChunk, value=p) for p in payloads]


def test_each_streamed_content_chunk_carries_its_tokens() -> None:
    body = {"model": "m", "messages": USER, "stream": True, "logprobs": True, "top_logprobs": 2}
    chunks = [c for c in _chunks(body, [*ANSWER, *END]) if c.choices]
    assert [c.choices[0].logprobs is None for c in chunks] == [True, False, False, True]
    content = [e.model_dump() for c in chunks[1:3] for e in c.choices[0].logprobs.content]
    assert content == [_wire(HELLO), _wire(LO)]
    assert chunks[1].choices[0].logprobs.refusal is None
    unasked = _chunks({"model": "m", "messages": USER, "stream": True}, [*ANSWER, *END])
    assert all(c.choices[0].logprobs is None for c in unasked if c.choices)


def test_the_whole_answer_carries_every_token() -> None:
    request, _ = chat.parse({"model": "m", "messages": USER, "logprobs": True})
    acc = Accumulator()
    for event in [*ANSWER, *END]:
        acc.add(event)
    body = chat.completion_body(request, acc)
    completion = openai_models.validate_type(type_=ChatCompletion, value=body)
    assert [e.model_dump() for e in completion.choices[0].logprobs.content] == [
        _wire(HELLO),
        _wire(LO),
    ]
    assert body["choices"][0]["logprobs"]["refusal"] is None
    unasked, _ = chat.parse({"model": "m", "messages": USER})
    assert chat.completion_body(unasked, acc)["choices"][0]["logprobs"] is None


def test_each_choice_has_its_own_tokens() -> None:
    request, _ = chat.parse({"model": "m", "messages": USER, "logprobs": True, "n": 2})
    acc = Accumulator()
    events = [
        ChoiceEvent(1, TextDelta("lo é", logprobs=(LO,))),
        ChoiceEvent(0, TextDelta("Hel", logprobs=(HELLO,))),
        ChoiceEvent(0, Done()),
        ChoiceEvent(1, Done()),
        Usage(3, 2),
        Done(),
    ]
    for event in events:
        acc.add(event)
    choices = chat.completion_body(request, acc)["choices"]
    assert [[e["token"] for e in c["logprobs"]["content"]] for c in choices] == [["Hel"], ["lo é"]]


@pytest.mark.parametrize("stream", [False, True])
async def test_the_gateway_answers_with_the_upstreams_logprobs(stream: bool) -> None:
    """Before issue #44 the gateway answered ``"logprobs": null`` whatever the worker said."""
    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), ScriptedUpstream.of(*ANSWER, *END))
    app = create_app(directory, GatewayConfig(retry_backoff_ms=1))
    body = {"model": "m", "messages": USER, "logprobs": True, "top_logprobs": 2, "stream": stream}
    result = await asgi_request(app, "POST", "/v1/chat/completions", body)
    assert result.status == 200, result.body
    if stream:
        lines = result.body.decode().split("\n\n")
        chunks = [orjson.loads(b[6:]) for b in lines if b.startswith("data: {")]
        content = [
            e
            for c in chunks
            for ch in c["choices"]
            if ch["logprobs"]
            for e in ch["logprobs"]["content"]
        ]
    else:
        content = result.json()["choices"][0]["logprobs"]["content"]
    assert content == [_wire(HELLO), _wire(LO)]
    assert bytes(content[1]["bytes"]).decode() == "lo é"
