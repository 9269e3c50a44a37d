"""Router: retry once before the commit point (first content delta), never after; route headers."""

from __future__ import annotations

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.events import Done, Error, Meta, Progress, TextDelta, Usage
from gateway.request import ChatRequest, Message
from gateway.router import RouteError, Router
from gateway.testing import Raise, ScriptedUpstream, Stall, asgi_request, text_script
from gateway.upstream import ModelInfo, StaticDirectory

REQUEST = ChatRequest(model="m", messages=[Message(role="user", content="hi")])
BUSY = Error(kind="unavailable", message="busy", retryable=True)


def _router(*upstreams: ScriptedUpstream) -> Router:
    directory = StaticDirectory()
    for upstream in upstreams:
        directory.add(
            ModelInfo(id="m"), upstream, kind="local" if upstream.name == "local" else "peer"
        )
    return Router(directory, retry_backoff_s=0.001)


async def _run(router: Router) -> list:
    return [event async for event in router.stream(REQUEST, router.resolve(REQUEST))]


def _meta(events: list) -> Meta:
    """The route headers as the client sees them: every Meta merged, later ones win."""
    merged: dict[str, str] = {}
    for event in events:
        if isinstance(event, Meta):
            merged |= event.headers
    return Meta(merged)


async def test_retryable_error_before_first_delta_is_retried_on_same_route():
    upstream = ScriptedUpstream(scripts=[[BUSY], text_script("ok")], name="local")
    events = await _run(_router(upstream))
    assert upstream.calls == 2
    meta = _meta(events)
    assert meta.headers["x-attempts"] == "2" and meta.headers["x-route"] == "local"
    assert "local:unavailable" in meta.headers["x-retry-reasons"]
    assert isinstance(events[-1], Done)


async def test_a_whole_answer_lost_midway_is_retried_elsewhere_for_a_non_stream_client():
    """Nothing reached a client that waits for the whole answer: a failure mid-answer is still
    before the commit point, and only the answer that completed reaches it (found by the lab's
    sigstop scenario: a 502 where a retry or a 503 was due)."""
    dying = ScriptedUpstream.of(TextDelta("half an ans"), BUSY, name="peer-a")
    healthy = ScriptedUpstream.of(*text_script("whole"), name="peer-b")
    router = _router(dying, healthy)
    request = REQUEST.model_copy(update={"stream": False})
    events = [e async for e in router.stream(request, router.resolve(request))]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "whole"
    assert isinstance(events[-1], Done) and _meta(events).headers["x-peer"] == "peer-b"


async def test_a_streamed_answer_lost_midway_is_not_retried():
    dying = ScriptedUpstream.of(TextDelta("half"), BUSY, name="peer-a")
    healthy = ScriptedUpstream.of(*text_script("whole"), name="peer-b")
    events = await _run(_router(dying, healthy))
    assert healthy.calls == 0 and events[-1] == BUSY


async def test_early_usage_waits_for_the_commit_and_does_not_commit():
    early = Usage(9, 0)
    upstream = ScriptedUpstream(
        scripts=[[early, BUSY], [early, TextDelta("ok"), Usage(9, 1), Done()]], name="local"
    )
    events = await _run(_router(upstream))
    assert upstream.calls == 2  # the Usage before the failure did not commit the first attempt
    assert [type(e) for e in events] == [Meta, Usage, TextDelta, Usage, Done]
    assert events[1] == early  # once, from the attempt that answered, right before its content


async def test_progress_note_goes_out_at_once_and_does_not_commit():
    note = Progress("asking 2 models…")
    upstream = ScriptedUpstream(
        scripts=[[Meta({"x-moa-workers": "2"}), note, BUSY], [note, *text_script("ok")]],
        name="local",
    )
    events = await _run(_router(upstream))
    assert upstream.calls == 2  # the note before the failure did not commit the first attempt
    # Each note follows the route facts known by then, so they can reach the headers first.
    first = events[0].headers
    assert (first["x-attempts"], first["x-moa-workers"]) == ("1", "2")
    assert events[1] == note and events.count(note) == 2
    assert _meta(events).headers["x-attempts"] == "2" and isinstance(events[-1], Done)


async def test_a_failed_moa_fan_out_is_not_run_again():
    moa = ScriptedUpstream.of(Progress("asking 2 models…"), BUSY, name="moa")
    moa.retryable = False  # as MixtureOfAgents says
    app = create_app(StaticDirectory(), GatewayConfig(retry_backoff_ms=1), moa=moa)
    body = {"model": "mesh", "messages": [{"role": "user", "content": "hi"}]}
    result = await asgi_request(app, "POST", "/v1/chat/completions", body)
    assert moa.calls == 1 and result.status == 503
    assert result.headers["x-attempts"] == "1"


async def test_exception_before_first_delta_is_retried_then_next_route():
    first = ScriptedUpstream(scripts=[[Raise(ConnectionError("refused"))]], name="local")
    second = ScriptedUpstream.of(*text_script("from peer"), name="peer-b")
    events = await _run(_router(first, second))
    assert first.calls == 2 and second.calls == 1
    meta = _meta(events)
    assert meta.headers["x-attempts"] == "3" and meta.headers["x-peer"] == "peer-b"
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "from peer"


async def test_error_after_first_delta_is_not_retried():
    upstream = ScriptedUpstream(
        scripts=[[TextDelta("par"), BUSY], text_script("never")], name="local"
    )
    events = await _run(_router(upstream))
    assert upstream.calls == 1
    assert events[-1] == BUSY
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["par"]


async def test_exception_after_first_delta_becomes_error_event():
    upstream = ScriptedUpstream.of(
        TextDelta("a"), Raise(RuntimeError("socket closed")), name="local"
    )
    events = await _run(_router(upstream))
    assert upstream.calls == 1
    assert isinstance(events[-1], Error) and events[-1].kind == "upstream"


async def test_non_retryable_error_is_passed_on_at_once():
    refused = Error(kind="invalid_request", message="bad")
    upstream = ScriptedUpstream.of(refused, name="local")
    events = await _run(_router(upstream))
    assert upstream.calls == 1 and events[-1] == refused


async def test_all_attempts_fail_gives_last_error():
    upstream = ScriptedUpstream.of(BUSY, name="local")
    events = await _run(_router(upstream))
    assert upstream.calls == 2
    assert events[-1] == BUSY and _meta(events).headers["x-attempts"] == "2"


def test_unknown_model_and_unreachable_model():
    router = _router(ScriptedUpstream.of(Done(), name="local"))
    try:
        router.resolve(ChatRequest(model="zzz", messages=[]))
    except RouteError as exc:
        assert exc.error.status == 404 and "available: m" in exc.error.message
    else:
        raise AssertionError("expected RouteError")


async def test_retry_reaches_client_with_route_headers():

    upstream = ScriptedUpstream(scripts=[[BUSY], text_script("ok")], name="local")
    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), upstream)
    app = create_app(directory, GatewayConfig(retry_backoff_ms=1))
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    result = await asgi_request(app, "POST", "/v1/chat/completions", body)
    assert result.status == 200
    assert result.headers["x-attempts"] == "2" and result.headers["x-route"] == "local"
    assert result.body.endswith(b"data: [DONE]\n\n")


async def test_moa_hook_serves_model_mesh():

    moa = ScriptedUpstream.of(Meta({"x-moa-winner": "a"}), *text_script("mixed"), name="moa")
    app = create_app(StaticDirectory(), GatewayConfig(), moa=moa)
    models = await asgi_request(app, "GET", "/v1/models")
    assert [m["id"] for m in models.json()["data"]] == ["mesh"]
    body = {"model": "mesh", "messages": [{"role": "user", "content": "x"}]}
    result = await asgi_request(app, "POST", "/v1/chat/completions", body)
    assert result.json()["choices"][0]["message"]["content"] == "mixed"
    assert result.headers["x-moa-winner"] == "a" and result.headers["x-route"] == "moa"


async def test_slow_first_event_still_gets_route_headers():
    from gateway.testing import Sleep

    upstream = ScriptedUpstream.of(Sleep(0.05), *text_script("late"), name="local")
    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), upstream)
    app = create_app(directory, GatewayConfig(header_wait_s=0.01))
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    result = await asgi_request(app, "POST", "/v1/chat/completions", body)
    # One route: where it goes is settled; how many attempts it takes is not (a retry may come).
    assert result.headers["x-route"] == "local" and result.headers["x-peer"] == "local"
    assert "x-attempts" not in result.headers
    assert b": route x-attempts=1\n\n" in result.body
    assert b"late"[:3] in result.body and result.body.endswith(b"data: [DONE]\n\n")


async def test_retry_after_the_start_hold_never_names_the_dead_route_in_headers():
    """The first event comes after the start hold, from a retry on another peer: the headers
    carry only what was settled at the start, the final route follows in an SSE comment and
    in the request log."""
    from gateway.testing import Sleep

    dead = ScriptedUpstream.of(Sleep(0.05), BUSY, name="peer-dead")
    good = ScriptedUpstream.of(*text_script("from good"), name="peer-good")
    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), dead, kind="peer")
    directory.add(ModelInfo(id="m"), good, kind="peer")
    app = create_app(directory, GatewayConfig(header_wait_s=0.01, retry_backoff_ms=1))
    records: list = []
    app.state.gateway.metrics.listeners.append(records.append)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    result = await asgi_request(app, "POST", "/v1/chat/completions", body)
    assert result.status == 200 and dead.calls == 2 and good.calls == 1
    assert result.headers["x-route"] == "peer"
    assert "x-peer" not in result.headers and "x-attempts" not in result.headers
    assert b": route x-peer=peer-good x-attempts=3 x-retry-reasons=" in result.body
    (record,) = records
    assert record.route["x-peer"] == "peer-good" and record.route["x-attempts"] == "3"


async def test_closing_the_stream_closes_the_upstream_call_at_once():
    """Closed at a yield (a pump whose send failed), the router closes the attempt and its
    upstream call before ``aclose`` returns, not when the garbage collector gets to them."""
    upstream = ScriptedUpstream.of(TextDelta("one"), Stall(), name="local")
    router = _router(upstream)
    events = router.stream(REQUEST, router.resolve(REQUEST))
    async for event in events:
        if isinstance(event, TextDelta):
            break
    await events.aclose()
    assert upstream.cancelled == 1 and upstream.active == 0


async def test_a_whole_answer_its_only_route_breaks_mid_way_twice_is_a_503() -> None:
    """No stream asked, the worker killed mid-answer on both tries: nothing reached the client,
    so it gets 503 (Retry-After), not the 502 of a broken answer."""
    broke = [TextDelta("par"), Error(kind="upstream", message="worker connection failed")]
    upstream = ScriptedUpstream(scripts=[broke, broke], name="local")
    router = _router(upstream)
    request = REQUEST.model_copy(update={"stream": False})
    events = [e async for e in router.stream(request, router.resolve(request))]
    assert events[-1] == Error(
        kind="unavailable", message="worker connection failed", retryable=True
    )
    assert _meta(events).headers["x-attempts"] == "2"
