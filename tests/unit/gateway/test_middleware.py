"""Limits and bad input: 401/413/429/400 in each API's error shape; the gateway keeps serving.
Also /health, /metrics and the JSONL request log."""

from __future__ import annotations

import asyncio

import orjson

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.events import TextDelta
from gateway.testing import ScriptedUpstream, Stall, asgi_request, text_script
from gateway.upstream import ModelInfo, StaticDirectory, Upstream

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
MESSAGES = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}


def _app(upstream: ScriptedUpstream | None = None, **config):
    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), upstream or ScriptedUpstream.of(*text_script("ok")))
    return create_app(directory, GatewayConfig(**config))


async def test_api_key_required_in_each_shape():
    app = _app(api_key="sekrit")
    denied = await asgi_request(app, "POST", "/v1/chat/completions", CHAT)
    assert denied.status == 401 and denied.json()["error"]["type"] == "authentication_error"
    denied = await asgi_request(
        app, "POST", "/v1/messages", MESSAGES, headers=[("x-api-key", "wrong")]
    )
    assert denied.status == 401 and denied.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid or missing API key"},
    }
    ok = await asgi_request(
        app, "POST", "/v1/chat/completions", CHAT, headers=[("authorization", "Bearer sekrit")]
    )
    assert ok.status == 200
    ok = await asgi_request(
        app, "POST", "/v1/messages", MESSAGES, headers=[("x-api-key", "sekrit")]
    )
    assert ok.status == 200
    assert (await asgi_request(app, "GET", "/health")).status == 200


async def test_body_too_large_is_413_then_still_serving():
    app = _app(max_body_bytes=200)
    big = dict(CHAT, messages=[{"role": "user", "content": "y" * 500}])
    result = await asgi_request(app, "POST", "/v1/chat/completions", big)
    assert result.status == 413 and "exceeds 200 bytes" in result.json()["error"]["message"]
    assert (await asgi_request(app, "POST", "/v1/chat/completions", CHAT)).status == 200


async def test_malformed_json_and_schema_errors_name_the_problem():
    app = _app()
    bad = await asgi_request(app, "POST", "/v1/chat/completions", b"{not json")
    assert bad.status == 400 and "malformed JSON" in bad.json()["error"]["message"]
    bad = await asgi_request(app, "POST", "/v1/chat/completions", {"model": "m"})
    assert bad.status == 400 and bad.json()["error"]["message"].startswith("messages")
    bad = await asgi_request(
        app, "POST", "/v1/responses", {"model": "m", "input": [{"type": "wat"}]}
    )
    assert bad.status == 400 and "input.0.type" in bad.json()["error"]["message"]
    bad = await asgi_request(app, "POST", "/v1/messages", [1, 2])
    assert bad.status == 400 and bad.json()["type"] == "error"
    assert (await asgi_request(app, "POST", "/v1/chat/completions", CHAT)).status == 200


async def test_in_flight_limit_is_429_with_retry_after():
    upstream = ScriptedUpstream(scripts=[[TextDelta("a"), Stall()], text_script("ok")])
    app = _app(upstream, max_in_flight=1, header_wait_s=0.01)
    stream_body = dict(CHAT, stream=True)
    first = asyncio.create_task(
        asgi_request(app, "POST", "/v1/chat/completions", stream_body, disconnect_after_s=0.2)
    )
    await upstream.started.wait()
    second = await asgi_request(app, "POST", "/v1/chat/completions", CHAT)
    assert second.status == 429 and second.headers["retry-after"] == "1"
    await first
    assert (await asgi_request(app, "POST", "/v1/chat/completions", CHAT)).status == 200


async def test_health_metrics_and_request_log(tmp_path):
    log_path = tmp_path / "requests.jsonl"
    app = _app(request_log=log_path)
    await asgi_request(app, "POST", "/v1/chat/completions", dict(CHAT, stream=True))
    await asgi_request(app, "POST", "/v1/chat/completions", dict(CHAT, model="nope"))
    health = (await asgi_request(app, "GET", "/health")).json()
    assert health["status"] == "ok" and health["models"] == ["m"] and health["in_flight"] == 0
    assert {"version", "queue_depth", "uptime_s"} <= set(health)
    metrics = (await asgi_request(app, "GET", "/metrics")).body.decode()
    assert 'gateway_requests_total{api="chat",model="m",outcome="ok"} 1.0' in metrics
    assert 'gateway_requests_total{api="chat",model="(unknown)",outcome="not_found"} 1.0' in metrics
    assert "gateway_ttft_seconds_count" in metrics
    await asgi_request(app, "POST", "/v1/chat/completions", b"{")
    metrics = (await asgi_request(app, "GET", "/metrics")).body.decode()
    assert (
        'gateway_requests_total{api="chat",model="(unknown)",outcome="invalid_request"} 1.0'
        in metrics
    )
    rows = [orjson.loads(line) for line in log_path.read_bytes().splitlines()]
    ok = next(r for r in rows if r["outcome"] == "ok")
    assert (
        ok["prompt_tokens"] == 7 and ok["cached_tokens"] == 2 and ok["route"]["x-route"] == "local"
    )
    assert ok["ttft_s"] is not None


async def test_health_counts_waiting_requests_as_queue_depth():
    upstream = ScriptedUpstream.of(Stall())
    app = _app(upstream)
    pending = asyncio.create_task(
        asgi_request(app, "POST", "/v1/chat/completions", CHAT, disconnect_after_s=0.5)
    )
    await upstream.started.wait()
    health = (await asgi_request(app, "GET", "/health")).json()
    assert health["queue_depth"] == 1 and health["in_flight"] == 1
    await pending
    health = (await asgi_request(app, "GET", "/health")).json()
    assert health["queue_depth"] == 0 and health["in_flight"] == 0
    assert upstream.cancelled == 1


async def test_unknown_path_and_method_answer_in_json():
    app = _app()
    missing = await asgi_request(app, "GET", "/v1/nothing")
    assert missing.status == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong = await asgi_request(app, "GET", "/v1/messages")
    assert wrong.status == 405 and wrong.json()["type"] == "error"
    assert "allow" in wrong.headers


async def test_health_survives_a_failing_status_source():
    def broken() -> dict:
        raise RuntimeError("peer table locked")

    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), ScriptedUpstream.of(*text_script("ok")))
    app = create_app(directory, GatewayConfig(), status=broken)
    health = await asgi_request(app, "GET", "/health")
    assert (
        health.status == 200 and health.json()["status_error"] == "RuntimeError: peer table locked"
    )


class _EchoUpstream(Upstream):
    """Streams the last user message back in small pieces, yielding between them."""

    name = "local"

    async def stream(self, request):
        from gateway.events import Done

        text = request.messages[-1].content
        for i in range(0, len(text), 2):
            await asyncio.sleep(0)
            yield TextDelta(text[i : i + 2])
        yield Done()


async def test_concurrent_streams_never_mix():
    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), _EchoUpstream())
    app = create_app(directory, GatewayConfig())

    async def one(i: int) -> tuple[int, bytes]:
        body = {
            "model": "m",
            "max_tokens": 9,
            "stream": True,
            "messages": [{"role": "user", "content": f"<{i:03d}>" * 5}],
        }
        result = await asgi_request(app, "POST", "/v1/messages", body)
        return i, result.body

    results = await asyncio.gather(*(one(i) for i in range(60)))
    for i, body in results:
        text = "".join(
            orjson.loads(line[6:])["delta"]["text"]
            for line in body.decode().splitlines()
            if line.startswith("data: ") and '"text_delta"' in line
        )
        assert text == f"<{i:03d}>" * 5
    health = (await asgi_request(app, "GET", "/health")).json()
    assert health["in_flight"] == 0 and health["queue_depth"] == 0


async def test_a_rejected_request_is_logged_with_its_model_and_stream_flag(tmp_path):
    log_path = tmp_path / "requests.jsonl"
    app = _app(request_log=log_path)
    bad = dict(MESSAGES, max_tokens=0, stream=True, model="claude-x")
    assert (await asgi_request(app, "POST", "/v1/messages", bad)).status == 400
    row = orjson.loads(log_path.read_bytes().splitlines()[-1])
    assert (row["model"], row["stream"], row["outcome"]) == ("claude-x", True, "invalid_request")
    metrics = (await asgi_request(app, "GET", "/metrics")).body.decode()
    assert 'model="claude-x"' not in metrics  # client strings never become metric labels


async def test_session_headers_keep_a_session_on_one_route():
    upstream = ScriptedUpstream.of(*text_script("ok"))
    app = _app(upstream)
    headers = [("x-session-affinity", "ses_123")]
    await asgi_request(app, "POST", "/v1/chat/completions", CHAT, headers=headers)
    assert upstream.requests[-1].session_key == "ses_123"
    body = dict(CHAT, user="u1")  # the body's own session key wins
    await asgi_request(app, "POST", "/v1/chat/completions", body, headers=headers)
    assert upstream.requests[-1].session_key == "u1"


async def test_metrics_carry_the_workers_speculation_counters():
    """The node's status picture carries each worker's /health speculation block; /metrics
    exposes it by model (and nothing for a worker that has none)."""
    block = {"mode": "auto", "draft": "prompt lookup", "verify_steps": 4, "drafted": 20,
             "accepted": 15, "acceptance_rate": 0.75, "tokens_per_step": 4.75,
             "empty_drafts": 3}  # fmt: skip
    workers = {"m": {"restarts": 0, "speculation": block}, "other": {"restarts": 1}}
    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), ScriptedUpstream.of(*text_script("ok")))
    app = create_app(directory, GatewayConfig(), status=lambda: {"workers": workers})
    metrics = (await asgi_request(app, "GET", "/metrics")).body.decode()
    assert 'gateway_worker_speculation_drafted_tokens_total{model="m"} 20.0' in metrics
    assert 'gateway_worker_speculation_accepted_tokens_total{model="m"} 15.0' in metrics
    assert 'gateway_worker_speculation_verify_steps_total{model="m"} 4.0' in metrics
    assert 'gateway_worker_speculation_acceptance_rate{model="m"} 0.75' in metrics
    assert 'gateway_worker_speculation_tokens_per_step{model="m"} 4.75' in metrics
    assert 'gateway_worker_speculation_empty_drafts_total{model="m"} 3.0' in metrics
    assert 'model="other"' not in metrics
    block["drafted"] = 30  # read at each scrape
    metrics = (await asgi_request(app, "GET", "/metrics")).body.decode()
    assert 'gateway_worker_speculation_drafted_tokens_total{model="m"} 30.0' in metrics
