"""``x-moa-*`` facts reach the client's headers and the request record even when the MoA decides
later than the gateway's ordinary header wait, or sends a progress note first."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.events import Done, Event, Meta, Progress, TextDelta
from gateway.metrics import RequestRecord
from gateway.moa import MixtureOfAgents, MoaConfig
from gateway.request import ChatRequest
from gateway.testing import ScriptedUpstream, Sleep, Stall, Step, asgi_request, text_script
from gateway.upstream import ModelInfo, StartHold, StaticDirectory, Upstream

MOA_KEYS = ("x-moa-policy", "x-moa-workers", "x-moa-winner", "x-moa-decision-ms")
# The gateway's own header wait is far shorter than any decision below.
GATEWAY = GatewayConfig(header_wait_s=0.01, keepalive_s=0.5)


def paced(text: str, ttft: float = 0.0) -> list[Step]:
    steps: list[Step] = [Sleep(ttft)] if ttft else []
    for word in text.split(" "):
        steps += [TextDelta(word + " "), Sleep(0.005)]
    return steps


def serve(moa, directory=None):
    app = create_app(directory or StaticDirectory(), GATEWAY, moa=moa)
    records: list[RequestRecord] = []
    app.state.gateway.metrics.listeners.append(records.append)
    return app, records


async def ask_mesh(app, *, stream: bool = True, path: str = "/v1/chat/completions"):
    body = {"model": "mesh", "messages": [{"role": "user", "content": "Q?"}], "stream": stream}
    if path == "/v1/responses":
        body = {"model": "mesh", "input": "Q?", "stream": stream}
    return await asgi_request(app, "POST", path, body)


def two_workers(ttft: float) -> StaticDirectory:
    directory = StaticDirectory()
    for name, params in (("a", 2), ("b", 1)):
        directory.add(
            ModelInfo(name, parameters=params),
            ScriptedUpstream.of(*paced("The sky is blue today.", ttft), Done()),
        )
    return directory


async def test_consensus_decided_after_the_header_wait_still_sends_every_moa_header():
    directory = two_workers(ttft=0.05)
    moa = MixtureOfAgents(directory, MoaConfig(policy="consensus", grace_s=0.1))
    app, records = serve(moa, directory)
    result = await ask_mesh(app)
    assert result.status == 200 and result.body.endswith(b"data: [DONE]\n\n")
    assert all(key in result.headers for key in MOA_KEYS)
    assert result.headers["x-moa-policy"] == "consensus" and result.headers["x-moa-workers"] == "2"
    (record,) = records
    assert {k: record.route[k] for k in MOA_KEYS} == {k: result.headers[k] for k in MOA_KEYS}


async def test_a_shown_progress_note_starts_the_response_and_the_winner_goes_to_the_record():
    directory = two_workers(ttft=0.3)
    moa = MixtureOfAgents(directory, MoaConfig(progress=True))
    app, records = serve(moa, directory)
    result = await ask_mesh(app, path="/v1/responses")
    # Started at the note, before the decision: what was known then is in the headers.
    assert result.headers["x-moa-policy"] == "race" and "x-moa-winner" not in result.headers
    assert b"asking 2 models" in result.body and b"sky" in result.body
    assert records[0].route["x-moa-winner"] in ("a", "b")
    # Chat Completions has no channel for the note: it waits for the decision as always.
    chat = await ask_mesh(app)
    assert b"asking" not in chat.body and b"sky" in chat.body
    assert chat.headers["x-moa-winner"] in ("a", "b")


async def test_all_workers_failing_after_a_progress_note_gets_a_real_error_status():
    directory = StaticDirectory()
    for name in ("a", "b"):
        directory.add(ModelInfo(name), ScriptedUpstream.of(Stall()))
    moa = MixtureOfAgents(directory, MoaConfig(progress=True, first_token_timeout_s=0.05))
    app, records = serve(moa, directory)
    result = await ask_mesh(app)
    assert result.status == 504 and b"MoA workers failed" in result.body
    assert result.headers["x-moa-policy"] == "race" and records[0].status == 504
    # Responses shows the note, so its stream had started: the failure is its terminal event.
    shown = await ask_mesh(app, path="/v1/responses")
    assert shown.status == 200 and b"asking 2 models" in shown.body
    assert shown.body.rstrip().endswith(b"}") and b"event: response.failed" in shown.body


@dataclass
class LateDecider(Upstream):
    """An upstream that decides later than it promised the gateway to wait."""

    name: str = "late"
    start_hold = StartHold("x-moa-winner", wait_s=0.05)

    async def stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        yield Meta({"x-moa-policy": "reduce", "x-moa-workers": "3"})
        yield Progress("asking 3 models…")
        script = ScriptedUpstream.of(Sleep(0.2), Meta({"x-moa-winner": "w2"}), *text_script("ok"))
        async for event in script.stream(request):
            yield event


async def test_a_decision_past_the_bound_starts_without_it_but_the_record_keeps_it():
    app, records = serve(LateDecider())
    result = await ask_mesh(app, path="/v1/responses")
    assert result.status == 200 and result.headers["x-moa-policy"] == "reduce"
    assert "x-moa-winner" not in result.headers  # the response started at the bound
    assert b"asking 3 models" in result.body and b"event: response.completed" in result.body
    (record,) = records
    assert record.route["x-moa-winner"] == "w2" and record.route["x-moa-workers"] == "3"


async def test_non_streaming_and_other_apis_carry_the_headers_too():
    directory = two_workers(ttft=0.02)
    moa = MixtureOfAgents(directory, MoaConfig(policy="consensus", grace_s=0.05))
    app, _ = serve(moa, directory)
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        for stream in (False, True):
            body = {
                "model": "mesh",
                "stream": stream,
                "max_tokens": 16,
                "messages": [{"role": "user", "content": "Q?"}],
            }
            if path == "/v1/responses":
                body = {"model": "mesh", "stream": stream, "input": "Q?"}
            result = await asgi_request(app, "POST", path, body)
            assert result.status == 200, (path, stream, result.body[:200])
            assert all(key in result.headers for key in MOA_KEYS), (path, stream)


def voters(*answers: str) -> StaticDirectory:
    """One model whose successive calls answer ``answers`` in turn."""
    directory = StaticDirectory()
    scripts = [[TextDelta(a, logprob=-0.1), Done()] for a in answers]
    directory.add(ModelInfo("m", parameters=1), ScriptedUpstream(scripts=scripts))
    return directory


async def test_vote_costs_reach_headers_responses_metadata_and_metrics():
    import json

    directory = voters(*["7", "8", "7", "7"] * 3)  # three requests of four samples
    app, records = serve(MixtureOfAgents(directory, MoaConfig(policy="vote")), directory)
    body = {"model": "mesh", "messages": [{"role": "user", "content": "Q?"}]}
    body["metadata"] = {"moa_samples": "4"}
    chat = await asgi_request(app, "POST", "/v1/chat/completions", body)
    assert chat.headers["x-moa-votes"] == "7=3, 8=1" and chat.headers["x-moa-workers"] == "4"
    assert chat.headers["x-moa-decision"] == "complete" and chat.headers["x-moa-stopped"] == "0"
    for stream in (False, True):
        reply = await asgi_request(
            app,
            "POST",
            "/v1/responses",
            {"model": "mesh", "input": "Q?", "stream": stream, "metadata": {"moa_samples": "4"}},
        )
        text = reply.body.decode()
        final = (
            json.loads(text)
            if not stream
            else json.loads(text.split("event: response.completed\ndata: ")[1].split("\n")[0])[
                "response"
            ]
        )
        metadata = final["metadata"]
        assert metadata["moa_samples"] == "4"  # the caller's own pairs stay
        assert metadata["moa_policy"] == "vote" and metadata["moa_votes"] == "7=3, 8=1"
        assert {"moa_winner", "moa_decision_ms", "moa_stopped", "moa_workers"} <= set(metadata)
    exposition = (await asgi_request(app, "GET", "/metrics")).body.decode()
    assert 'gateway_moa_requests_total{decision="complete",policy="vote"} 3.0' in exposition
    assert 'gateway_moa_candidates_total{fate="started",policy="vote"} 12.0' in exposition
    assert 'gateway_moa_decision_seconds_count{policy="vote"} 3.0' in exposition
    assert len(records) == 3
