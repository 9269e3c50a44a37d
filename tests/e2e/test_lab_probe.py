"""The probe end to end against a real HTTP server on loopback: a Starlette double that speaks
the three client APIs and misbehaves on request (error events, hung and cut-off streams)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.testing import ServerThread
from lab.measure import Target, list_models, measure_request
from lab.probe import ProbeConfig, Prober, parse_args, run_probe
from lab.report import read_rows
from lab.rows import Outcome

HEADERS = {"x-route": "peer", "x-peer": "node-b"}
WORDS = ["pine", "apple", " pie"]


def _sse(event: str | None, data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else orjson.dumps(data).decode()
    return (f"event: {event}\n" if event else "").encode() + f"data: {payload}\n\n".encode()


def _frames(api: str, words: list[str]) -> tuple[list[bytes], bytes, bytes]:
    """(content frames, terminal frame, error frame) in ``api``'s wire format."""
    if api == "chat":
        content = [_sse(None, {"choices": [{"delta": {"content": w}}]}) for w in words]
        usage = _sse(None, {"choices": [], "usage": {"completion_tokens": len(words)}})
        return content, usage + _sse(None, "[DONE]"), _sse(None, {"error": {"message": "boom"}})
    if api == "responses":
        content = [
            _sse("response.output_text.delta", {"type": "response.output_text.delta", "delta": w})
            for w in words
        ]
        done = {"type": "response.completed", "response": {"usage": {"output_tokens": len(words)}}}
        return (
            content,
            _sse("response.completed", done),
            _sse("error", {"type": "error", "message": "boom"}),
        )
    start = _sse("message_start", {"type": "message_start", "message": {"usage": {}}})
    content = [
        _sse(
            "content_block_delta",
            {"type": "content_block_delta", "delta": {"type": "text_delta", "text": w}},
        )
        for w in words
    ]
    content[0] = start + content[0]
    stop = _sse("message_delta", {"type": "message_delta", "usage": {"output_tokens": len(words)}})
    stop += _sse("message_stop", {"type": "message_stop"})
    error = _sse("error", {"type": "error", "error": {"type": "api_error", "message": "boom"}})
    return content, stop, error


def _nonstream(api: str, text: str) -> dict:
    if api == "chat":
        return {"choices": [{"message": {"content": text}}], "usage": {"completion_tokens": 1}}
    if api == "responses":
        return {"output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}]}
    return {"content": [{"type": "text", "text": text}], "usage": {"output_tokens": 1}}


class DoubleGateway:
    """Model names choose behaviour: good, wrong (sentinel fails), error, hang, cut, absent."""

    def __init__(self) -> None:
        self.release = threading.Event()  # set at teardown so hung handlers end
        self.requests: list[dict] = []
        routes = [
            Route("/v1/models", self.models),
            Route("/v1/chat/completions", self.handler("chat"), methods=["POST"]),
            Route("/v1/responses", self.handler("responses"), methods=["POST"]),
            Route("/v1/messages", self.handler("messages"), methods=["POST"]),
        ]
        self.app = Starlette(routes=routes)

    async def models(self, request: Request) -> Response:
        data = [{"id": m, "object": "model"} for m in ("good", "wrong", "error", "hang", "cut")]
        return JSONResponse({"object": "list", "data": data})

    async def _hold(self) -> None:
        await asyncio.to_thread(self.release.wait)

    def handler(self, api: str):
        async def handle(request: Request) -> Response:
            body = orjson.loads(await request.body())
            self.requests.append({"api": api, **body})
            model = body["model"]
            if model not in ("good", "wrong", "error", "hang", "cut", "mesh"):
                return JSONResponse({"error": {"message": f"no model {model}"}}, 404)
            if not body.get("stream"):
                if model == "error":
                    return JSONResponse(
                        {"error": {"message": "no capacity"}}, 503, headers={"retry-after": "2"}
                    )
                text = "Pineapple." if model in ("good", "mesh") else "banana"
                return JSONResponse(_nonstream(api, text), headers=HEADERS)
            content, terminal, error = _frames(api, WORDS)

            async def stream() -> AsyncIterator[bytes]:
                yield b": keep-alive\n\n"
                for frame in content:
                    await asyncio.sleep(0.01)
                    yield frame
                if model == "error":
                    yield error
                elif model == "hang":
                    await self._hold()
                elif model != "cut":
                    yield terminal

            return StreamingResponse(stream(), media_type="text/event-stream", headers=HEADERS)

        return handle


async def wait_until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


@pytest.fixture
def gateway() -> Iterator[tuple[DoubleGateway, str]]:
    double = DoubleGateway()
    with ServerThread(double.app) as server:
        try:
            yield double, server.url
        finally:
            double.release.set()


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_outcomes_per_api(gateway, api) -> None:
    double, url = gateway
    target = Target("a", url)
    import httpx

    async with httpx.AsyncClient(trust_env=False) as client:

        async def probe(model: str, stream: bool = True, timeout_s: float = 5.0):
            return await measure_request(
                client,
                target,
                api=api,
                model=model,
                prompt="p",
                stream=stream,
                max_tokens=4,
                timeout_s=timeout_s,
                sentinel_word=None if stream else "pineapple",
            )

        good = await probe("good")
        assert good.outcome is Outcome.OK and good.text == "pineapple pie"
        assert (good.tokens, good.route, good.peer) == (3, "peer", "node-b")
        assert good.ttft_s is not None and 0 < good.ttft_s <= good.duration_s
        assert good.tok_s is not None and good.tok_s > 0
        assert (await probe("error")).outcome is Outcome.ERROR_EVENT
        cut = await probe("cut")
        assert cut.outcome is Outcome.TRUNCATED and cut.text == "pineapple pie"
        hung = await probe("hang", timeout_s=0.5)
        assert hung.outcome is Outcome.HUNG and "never terminated" in (hung.error or "")
        missing = await probe("absent")
        assert (missing.outcome, missing.status) == (Outcome.HTTP_ERROR, 404)
        assert "no model absent" in (missing.error or "")

        sentinel = await probe("good", stream=False)
        assert (sentinel.outcome, sentinel.sentinel_ok, sentinel.kind) == (
            Outcome.OK,
            True,
            "sentinel",
        )
        wrong = await probe("wrong", stream=False)
        # Transport fine, answer wrong: recorded apart.
        assert (wrong.outcome, wrong.sentinel_ok) == (Outcome.OK, False)
        unavailable = await probe("error", stream=False)
        assert (unavailable.outcome, unavailable.status, unavailable.sentinel_ok) == (
            Outcome.HTTP_ERROR,
            503,
            None,
        )
        # The Retry-After is kept: it is what makes a 503 a proper refusal, not a server bug.
        assert unavailable.retry_after == "2" and unavailable.failed_properly
        assert missing.failed_properly and not cut.failed_properly and not hung.failed_properly
    sent = [r for r in double.requests if r["api"] == api]
    assert all(r["temperature"] == 0 for r in sent)


async def test_timeout_before_head_and_refused_connection() -> None:
    import socket

    import httpx

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()  # accepts into the backlog, never answers
    try:
        async with httpx.AsyncClient(trust_env=False) as client:
            row = await measure_request(
                client,
                Target("a", f"http://127.0.0.1:{listener.getsockname()[1]}"),
                api="chat",
                model="m",
                prompt="p",
                stream=True,
                max_tokens=4,
                timeout_s=0.3,
            )
            assert row.outcome is Outcome.TIMEOUT
            free = socket.socket()
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
            free.close()
            refused = await measure_request(
                client,
                Target("a", f"http://127.0.0.1:{port}"),
                api="chat",
                model="m",
                prompt="p",
                stream=True,
                max_tokens=4,
                timeout_s=2,
            )
            assert refused.outcome is Outcome.TRANSPORT_ERROR
            models_row, ids = await list_models(
                client, Target("a", f"http://127.0.0.1:{port}"), timeout_s=2
            )
            assert (models_row.outcome, ids) == (Outcome.TRANSPORT_ERROR, [])
    finally:
        listener.close()


async def test_run_probe_writes_rows_summary_and_plots(gateway, tmp_path: Path) -> None:
    _, url = gateway
    config = ProbeConfig(
        urls=[url],
        models=["good", "error"],
        count=2,
        interval_s=0.01,
        out_dir=tmp_path,
        timeout_s=5,
        show_progress=False,
    )
    summary = await run_probe(config)
    rows = read_rows(tmp_path / "rows.jsonl")
    # per round: 1 listing + 2 models × 3 apis × (sentinel + stream)
    assert len(rows) == summary.requests == 2 * (1 + 2 * 3 * 2)
    assert {(r.model, r.api) for r in rows if r.kind == "stream"} == {
        (m, a) for m in ("good", "error") for a in ("chat", "responses", "messages")
    }
    assert summary.hung == 0
    assert summary.outcomes == {"error_event": 6, "http_error": 6, "ok": 2 + 12}
    good_chat = next(g for g in summary.groups if (g.model, g.api) == ("good", "chat"))
    assert (good_chat.requests, good_chat.ok, good_chat.sentinel_passed) == (4, 4, 2)
    assert good_chat.ttft_p50_s is not None and good_chat.tok_s_p50 is not None
    saved = orjson.loads((tmp_path / "summary.json").read_bytes())
    assert saved["requests"] == len(rows)
    assert "hung: 0" in (tmp_path / "summary.md").read_text()
    for name in ("ttft.png", "tok_s.png", "failures.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


async def test_default_models_come_from_the_listing_plus_mesh_and_ab_interleaves(gateway) -> None:
    _, url = gateway
    config = ProbeConfig(
        urls=[url, url + "/"], apis=["chat"], count=1, sentinel=False, timeout_s=0.5
    )
    prober = Prober(config)
    rows = await prober.run()
    streamed = [r for r in rows if r.kind == "stream"]
    assert [r.model for r in streamed if r.target == "a"] == [
        "good",
        "wrong",
        "error",
        "hang",
        "cut",
        "mesh",
    ]
    # interleaved: each model is probed on a then b before the next model
    assert [r.target for r in streamed][:4] == ["a", "b", "a", "b"]
    assert sum(1 for r in rows if r.outcome is Outcome.HUNG) == 2


async def test_stop_event_ends_an_endless_probe(gateway) -> None:
    _, url = gateway
    prober = Prober(
        ProbeConfig(urls=[url], models=["good"], apis=["chat"], interval_s=0.05, timeout_s=5)
    )
    stop = asyncio.Event()
    task = asyncio.create_task(prober.run(stop))
    await wait_until(lambda: len(prober.rows) >= 6)
    stop.set()
    rows = await asyncio.wait_for(task, 10)
    assert all(r.ok for r in rows)


async def test_cancelled_probe_still_writes_its_summary(gateway, tmp_path: Path) -> None:
    _, url = gateway
    config = ProbeConfig(
        urls=[url],
        models=["good"],
        apis=["chat"],
        interval_s=0.05,
        out_dir=tmp_path,
        timeout_s=5,
        show_progress=False,
    )
    task = asyncio.create_task(run_probe(config))
    rows_path = tmp_path / "rows.jsonl"
    await wait_until(lambda: rows_path.exists() and len(read_rows(rows_path)) >= 3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    summary = orjson.loads((tmp_path / "summary.json").read_bytes())
    assert summary["requests"] == len(read_rows(tmp_path / "rows.jsonl")) >= 3


def test_cli_arguments() -> None:
    config = parse_args(
        [
            "--url",
            "http://h:1",
            "--models",
            "a,b",
            "--apis",
            "chat,messages",
            "--count",
            "3",
            "--ab",
            "http://h:2",
        ]
    )
    assert config.urls == ["http://h:1", "http://h:2"] and config.models == ["a", "b"]
    assert config.apis == ["chat", "messages"] and config.count == 3
    with pytest.raises(SystemExit):
        parse_args(["--url", "http://h:1", "--apis", "chat,smoke"])
    with pytest.raises(SystemExit):
        parse_args(["--url", "http://h:1", "--count", "1", "--duration", "2"])


async def test_probe_against_the_real_gateway_over_a_scripted_upstream(tmp_path: Path) -> None:
    """The gateway's own encoders for all three APIs, read by the probe: every probe ok."""
    from gateway.app import create_app
    from gateway.testing import ScriptedUpstream, text_script
    from gateway.upstream import ModelInfo, StaticDirectory

    directory = StaticDirectory()
    upstream = ScriptedUpstream(scripts=[text_script("Pineapple, then more words")], name="local")
    directory.add(ModelInfo("scripted"), upstream)
    with ServerThread(create_app(directory)) as server:
        config = ProbeConfig(
            urls=[server.url],
            count=1,
            out_dir=tmp_path,
            timeout_s=10,
            include_mesh=False,
            show_progress=False,
        )
        summary = await run_probe(config)
    rows = read_rows(tmp_path / "rows.jsonl")
    assert summary.outcomes == {"ok": 1 + 3 * 2}, [r.error for r in rows if not r.ok]
    probes = [r for r in rows if r.kind != "models"]
    assert {r.api for r in probes} == {"chat", "responses", "messages"}
    assert all(r.text == "Pineapple, then more words" and r.route == "local" for r in probes)
    assert all(r.sentinel_ok for r in probes if r.kind == "sentinel")
    assert all(r.tokens == 5 for r in probes)  # the script's usage, through every API
    # thinking off went through each API's own knob
    assert [req.reasoning for req in upstream.requests] == [False] * 6
    assert all(req.temperature == 0 for req in upstream.requests)
