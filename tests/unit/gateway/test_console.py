"""The console's server side: the pure feed, the request ring buffer and the routes."""

from __future__ import annotations

import asyncio

import orjson
from starlette.applications import Starlette

from gateway.console import ConsoleFeed, RecentRequests, console_routes, console_row
from gateway.metrics import RequestRecord
from gateway.testing import ScriptedUpstream, asgi_request
from gateway.upstream import ModelInfo, StaticDirectory


def frames_of(body: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in body.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in lines:
            out.append((lines["event"], orjson.loads(lines["data"])))
    return out


def make_directory(*models: str) -> StaticDirectory:
    directory = StaticDirectory()
    for model in models:
        directory.add(ModelInfo(id=model), ScriptedUpstream.of(name="local"))
    return directory


# ---------------------------------------------------------------- pure feed


def test_feed_sends_status_once_until_it_changes() -> None:
    feed = ConsoleFeed(heartbeat_s=5)
    first = feed.step(0.0, {"node": {"id": "a"}, "peers": []})
    assert [f.split(b"\n")[0] for f in first] == [b"event: status"]
    assert feed.step(1.0, {"peers": [], "node": {"id": "a"}}) == []  # same content, other order
    changed = feed.step(2.0, {"node": {"id": "a"}, "peers": [{"id": "b"}]})
    assert frames_of(b"".join(changed)) == [
        ("status", {"node": {"id": "a"}, "peers": [{"id": "b"}]})
    ]


def test_feed_heartbeats_only_when_quiet() -> None:
    feed = ConsoleFeed(heartbeat_s=5)
    feed.step(0.0, {"node": {}})
    assert feed.step(4.9, {"node": {}}) == []
    beat = feed.step(5.0, {"node": {}})
    assert frames_of(b"".join(beat))[0][0] == "heartbeat"
    assert feed.step(6.0, {"node": {}}) == []
    # Other frames reset the heartbeat clock.
    feed.step(9.0, {"node": {"x": 1}})
    assert feed.step(13.0, {"node": {"x": 1}}) == []
    assert feed.step(14.0, {"node": {"x": 1}}) != []


def test_feed_forwards_each_request_once_in_order() -> None:
    feed = ConsoleFeed()
    news = [(1, {"model": "a"}), (2, {"model": "b"})]
    frames = frames_of(b"".join(feed.step(0.0, None, news)))
    assert frames == [("request", {"model": "a"}), ("request", {"model": "b"})]
    assert feed.request_seq == 2
    assert frames_of(b"".join(feed.step(0.1, None, [*news, (3, {"model": "c"})]))) == [
        ("request", {"model": "c"})
    ]


# ---------------------------------------------------------------- request ring buffer


def test_recent_requests_is_bounded_and_numbered() -> None:
    log = RecentRequests(maxlen=3)
    for i in range(5):
        log.record({"model": f"m{i}"})
    assert [r["model"] for r in log.rows()] == ["m2", "m3", "m4"]
    assert log.last_seq == 5
    assert [(s, r["model"]) for s, r in log.since(3)] == [(4, "m3"), (5, "m4")]
    assert log.since(5) == []


def test_gateway_record_becomes_a_table_row() -> None:
    record = RequestRecord(
        api="responses",
        model="tiny",
        stream=True,
        started=1000.0,
        ttft_s=0.25,
        duration_s=2.25,
        completion_tokens=21,
        route={"x-route": "peer", "x-peer": "abcd", "x-attempts": "2", "x-moa-winner": "w1"},
    )
    log = RecentRequests()
    log.record(record)
    row = log.rows()[0]
    assert row["route"] == "peer"
    assert row["peer"] == "abcd"
    assert row["attempts"] == "2"
    assert row["moa_winner"] == "w1"
    assert row["ttft_ms"] == 250.0
    assert row["tok_s"] == 10.5  # 21 tokens over the 2 s after the first one
    assert row["at"] == 1000.0
    assert row["outcome"] == "ok"


def test_console_row_leaves_unknown_numbers_alone() -> None:
    row = console_row({"api": "chat", "ttft_s": None, "completion_tokens": 0, "duration_s": 0.0})
    assert "ttft_ms" not in row and "tok_s" not in row


# ---------------------------------------------------------------- routes


async def test_events_stream_status_requests_and_ends_on_disconnect() -> None:
    log = RecentRequests()
    log.record({"model": "old"})  # history is served by /api/requests, not replayed
    statuses = iter(
        [{"node": {"id": "n1"}, "peers": []}] * 2
        + [{"node": {"id": "n1"}, "peers": [{"id": "p"}]}] * 100
    )
    calls = 0

    async def provider() -> dict:
        nonlocal calls
        calls += 1
        if calls == 2:
            log.record({"model": "new"})
        return next(statuses)

    app = Starlette(routes=console_routes(provider, requests=log, poll_s=0.01, heartbeat_s=0.05))
    result = await asyncio.wait_for(
        asgi_request(app, "GET", "/api/events", disconnect_after_s=0.3), timeout=5
    )
    assert result.status == 200
    assert result.headers["content-type"].startswith("text/event-stream")
    frames = frames_of(result.body)
    kinds = [kind for kind, _ in frames]
    assert kinds[0] == "status"
    assert [data for kind, data in frames if kind == "request"] == [
        {"model": "new", "at": frames[1][1]["at"]}
    ]
    statuses_sent = [data for kind, data in frames if kind == "status"]
    assert statuses_sent == [
        {"node": {"id": "n1"}, "peers": []},
        {"node": {"id": "n1"}, "peers": [{"id": "p"}]},
    ]
    assert "heartbeat" in kinds
    # The poll loop ended with the response: no further provider calls after the disconnect.
    settled = calls
    await asyncio.sleep(0.1)
    assert calls == settled


async def test_events_without_provider_show_this_node_from_the_directory() -> None:
    app = Starlette(routes=console_routes(directory=make_directory("tiny", "small"), poll_s=0.01))
    result = await asgi_request(app, "GET", "/api/events", disconnect_after_s=0.1)
    kind, status = frames_of(result.body)[0]
    assert kind == "status"
    assert status["node"]["models"] == ["tiny", "small"]
    assert status["peers"] == []


async def test_partial_provider_is_completed_by_the_directory() -> None:
    app = Starlette(
        routes=console_routes(
            lambda: {"peers": [{"id": "p1"}]}, directory=make_directory("tiny"), poll_s=0.01
        )
    )
    result = await asgi_request(app, "GET", "/api/events", disconnect_after_s=0.1)
    _, status = frames_of(result.body)[0]
    assert status["node"]["models"] == ["tiny"]
    assert status["peers"] == [{"id": "p1"}]


async def test_failing_provider_is_reported_and_the_feed_survives() -> None:
    calls = 0

    def provider() -> dict:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise LookupError("peer table locked")  # any bug in a provider, not only I/O
        return {"node": {"id": "ok"}}

    app = Starlette(routes=console_routes(provider, poll_s=0.01))
    result = await asgi_request(app, "GET", "/api/events", disconnect_after_s=0.1)
    statuses = [data for kind, data in frames_of(result.body) if kind == "status"]
    assert "peer table locked" in statuses[0]["error"]
    assert statuses[1] == {"node": {"id": "ok"}}


async def test_page_static_files_and_request_history() -> None:
    log = RecentRequests()
    log.record({"api": "chat", "model": "tiny", "outcome": "ok"})
    app = Starlette(routes=console_routes(requests=log))
    page = await asgi_request(app, "GET", "/")
    assert page.status == 200 and b"mlx-mesh" in page.body
    assert page.headers["content-type"].startswith("text/html")
    for name in ("app.js", "markdown.js", "sse.js", "topology.js", "style.css"):
        static = await asgi_request(app, "GET", f"/static/{name}")
        assert static.status == 200, name
    missing = await asgi_request(app, "GET", "/static/nope.js")
    assert missing.status == 404
    history = (await asgi_request(app, "GET", "/api/requests")).json()
    assert [row["model"] for row in history["requests"]] == ["tiny"]
    empty = await asgi_request(Starlette(routes=console_routes()), "GET", "/api/requests")
    assert empty.json() == {"requests": []}


async def test_the_one_status_source_feeds_the_console_api_status_and_health() -> None:
    from gateway.app import create_app

    mesh_status = {
        "node": {"node_id": "n1", "mesh_id": "m1", "models": [{"name": "tiny"}]},
        "peers": [{"node_id": "p", "connected": True}, {"node_id": "q", "connected": False}],
    }
    app = create_app(make_directory("tiny"), status=lambda: mesh_status)
    result = await asgi_request(app, "GET", "/api/events", disconnect_after_s=0.6)
    assert frames_of(result.body)[0] == ("status", mesh_status)
    assert (await asgi_request(app, "GET", "/api/status")).json() == mesh_status
    health = (await asgi_request(app, "GET", "/health")).json()
    assert (health["node_id"], health["mesh_id"], health["peers"]) == ("n1", "m1", 1)
    assert "node" not in health  # a summary only


async def test_inside_the_gateway_the_status_source_and_directory_are_used() -> None:
    from gateway.app import create_app

    app = create_app(make_directory("tiny"), status=lambda: {"workers": {"tiny": {}}})
    result = await asgi_request(app, "GET", "/api/events", disconnect_after_s=0.6)
    _, status = frames_of(result.body)[0]
    assert status["node"]["models"] == ["tiny"]
    assert status["workers"] == {"tiny": {}}


async def test_close_event_streams_ends_open_feeds() -> None:
    from gateway.console import close_event_streams

    app = Starlette(routes=console_routes(poll_s=0.01))
    asyncio.get_running_loop().call_later(0.1, close_event_streams, app)
    # No disconnect: only the shutdown signal can end this response.
    result = await asyncio.wait_for(asgi_request(app, "GET", "/api/events"), timeout=5)
    assert result.status == 200


async def test_with_a_key_the_page_is_open_and_the_data_is_not() -> None:
    from gateway.app import create_app
    from gateway.config import GatewayConfig

    app = create_app(make_directory("tiny"), GatewayConfig(api_key="sekret"))
    assert (await asgi_request(app, "GET", "/")).status == 200
    assert (await asgi_request(app, "GET", "/static/app.js")).status == 200
    for path in ("/api/requests", "/api/events", "/v1/models"):
        assert (await asgi_request(app, "GET", path)).status == 401, path
    bearer = [("authorization", "Bearer sekret")]
    assert (await asgi_request(app, "GET", "/api/requests", headers=bearer)).status == 200
