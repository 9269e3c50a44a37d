"""``model="mesh"`` with progress notes, over HTTP with the official SDKs: Responses clients get
"asking N models…" as a reasoning summary before the answer; Chat Completions and Anthropic
Messages clients get no trace of it; the note survives the tunnel's event codec."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from openai.types.responses import (
    ResponseReasoningItem,
    ResponseReasoningSummaryPartAddedEvent,
    ResponseReasoningSummaryPartDoneEvent,
    ResponseReasoningSummaryTextDeltaEvent,
    ResponseReasoningSummaryTextDoneEvent,
)

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.events import Progress
from gateway.moa import MixtureOfAgents, MoaConfig
from gateway.testing import ScriptedUpstream, ServerThread, paced_script
from gateway.testing import Stall as StallStep
from gateway.upstream import ModelInfo, StaticDirectory
from mesh.peer_upstream import _decode_event
from mesh.tunnel_server import _encode

WINNER_TEXT = "The sky is blue today."
NOTE = "asking 2 models…"
USER = [{"role": "user", "content": "Q?"}]


@pytest.fixture(scope="module")
def server():
    """A gateway whose ``mesh`` races a quick worker (the winner) against a slow one."""
    directory = StaticDirectory()
    directory.add(ModelInfo("quick", parameters=1), ScriptedUpstream.of(*paced_script(WINNER_TEXT)))
    directory.add(
        ModelInfo("slow", parameters=2), ScriptedUpstream.of(*paced_script("Too late.", ttft=0.5))
    )
    moa = MixtureOfAgents(directory, MoaConfig(progress=True))
    with ServerThread(create_app(directory, GatewayConfig(), moa=moa)) as srv:
        yield srv


@pytest.fixture
def oai(server):
    with openai.OpenAI(
        base_url=server.url + "/v1", api_key="k", _strict_response_validation=True, max_retries=0
    ) as client:
        yield client


def winner_text(text: str) -> str:
    return text.strip()


# -- Responses: the note is a reasoning summary ---------------------------------------------------


def test_responses_stream_sends_the_note_as_a_summary_before_any_text(oai):
    events = list(oai.responses.create(model="mesh", input="Q?", stream=True))
    types = [e.type for e in events]
    assert types[:9] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
        "response.output_item.added",
    ]
    assert types.index("response.reasoning_summary_text.delta") < types.index(
        "response.output_text.delta"
    )
    added, part_added, delta, text_done, part_done, item_done = events[2:8]
    assert added.item.type == "reasoning" and added.item.summary == []
    assert added.item.content is None  # a summary, not the model's reasoning
    assert isinstance(part_added, ResponseReasoningSummaryPartAddedEvent)
    assert isinstance(delta, ResponseReasoningSummaryTextDeltaEvent)
    assert isinstance(text_done, ResponseReasoningSummaryTextDoneEvent)
    assert isinstance(part_done, ResponseReasoningSummaryPartDoneEvent)
    assert delta.delta == text_done.text == part_done.part.text == NOTE
    assert delta.item_id == added.item.id and delta.output_index == 0 and delta.summary_index == 0
    assert [s.text for s in item_done.item.summary] == [NOTE]
    final = events[-1].response
    assert events[-1].type == "response.completed"
    reasoning, message = final.output
    assert isinstance(reasoning, ResponseReasoningItem) and reasoning.content is None
    assert [s.text for s in reasoning.summary] == [NOTE]
    assert message.type == "message" and winner_text(final.output_text) == WINNER_TEXT


def test_responses_stream_helper_accepts_the_summary_item(oai):
    with oai.responses.stream(model="mesh", input="Q?") as stream:
        final = stream.get_final_response()
    assert [s.text for s in final.output[0].summary] == [NOTE]
    assert winner_text(final.output_text) == WINNER_TEXT


def test_responses_body_carries_the_summary_item(oai):
    response = oai.responses.create(model="mesh", input="Q?")
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and [s.text for s in reasoning.summary] == [NOTE]
    assert reasoning.content is None and message.type == "message"
    assert winner_text(response.output_text) == WINNER_TEXT
    # The note is not the model's reasoning: no reasoning tokens are claimed for it.
    assert response.usage.output_tokens_details.reasoning_tokens == 0


# -- Chat Completions and Messages: no channel, so no trace --------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": "mesh", "messages": USER}),
        ("/v1/messages", {"model": "mesh", "max_tokens": 32, "messages": USER}),
    ],
)
def test_other_apis_show_no_trace_of_the_note(server, path, body, stream):
    response = httpx.post(server.url + path, json={**body, "stream": stream}, timeout=10)
    assert response.status_code == 200
    assert "asking" not in response.text and "models…" not in response.text
    assert "today" in response.text


def test_sdk_clients_get_only_the_winners_answer(server, oai):
    completion = oai.chat.completions.create(model="mesh", messages=USER)
    message = completion.choices[0].message
    assert winner_text(message.content) == WINNER_TEXT
    assert "reasoning_content" not in (message.model_extra or {})
    chunks = list(oai.chat.completions.create(model="mesh", messages=USER, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert winner_text("".join(d.content or "" for d in deltas)) == WINNER_TEXT
    assert not any((d.model_extra or {}).get("reasoning_content") for d in deltas)
    with anthropic.Anthropic(
        base_url=server.url, api_key="k", _strict_response_validation=True, max_retries=0
    ) as claude:
        reply = claude.messages.create(model="mesh", max_tokens=32, messages=USER)
        assert [block.type for block in reply.content] == ["text"]
        assert winner_text(reply.content[0].text) == WINNER_TEXT
        with claude.messages.stream(model="mesh", max_tokens=32, messages=USER) as stream:
            final = stream.get_final_message()
        assert [block.type for block in final.content] == ["text"]


# -- the tunnel's codec -----------------------------------------------------------------------------


def test_progress_survives_the_tunnel_codec():
    note = Progress(NOTE)
    assert _decode_event(_encode(note)) == note


def test_the_note_reaches_a_responses_client_while_no_worker_has_answered():
    """The note is the answer to a spinner: it must arrive while every worker is still silent,
    not held back until the arbiter decides."""
    directory = StaticDirectory()
    for name in ("a", "b"):
        directory.add(ModelInfo(name), ScriptedUpstream.of(StallStep()))
    moa = MixtureOfAgents(directory, MoaConfig(progress=True, first_token_timeout_s=60))
    body = {"model": "mesh", "input": "Q?", "stream": True}
    with ServerThread(create_app(directory, GatewayConfig(), moa=moa)) as srv:
        with httpx.stream("POST", srv.url + "/v1/responses", json=body, timeout=10) as response:
            assert response.status_code == 200 and "x-moa-winner" not in response.headers
            for line in response.iter_lines():
                if line == "event: response.reasoning_summary_text.delta":
                    break
