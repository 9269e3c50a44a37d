"""Hedged first token: the backup starts only without content by the delay; first commit wins,
the other is cancelled at once; never after the commit, at most once, not when not allowed."""

from __future__ import annotations

from gateway.events import Done, Error, Meta, TextDelta
from gateway.hedge import HedgedUpstream
from gateway.request import ChatRequest, Message
from gateway.router import Route, Router
from gateway.testing import ScriptedUpstream, Sleep, Stall, text_script
from gateway.upstream import StaticDirectory

REQUEST = ChatRequest(model="m", messages=[Message(role="user", content="hi")])
HEADERS = ({"x-peer": "a"}, {"x-peer": "b"})


def _hedge(primary, backup, *, delay_s=0.01, allow=lambda: True, notes=None) -> HedgedUpstream:
    return HedgedUpstream(
        primary,
        backup,
        delay_s,
        HEADERS,
        allow=allow,
        on_hedge=None if notes is None else notes.append,
    )


async def _run(upstream) -> list:
    return [event async for event in upstream.stream(REQUEST)]


def _text(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def _merged(events) -> dict:
    out: dict = {}
    for e in events:
        if isinstance(e, Meta):
            out |= e.headers
    return out


async def test_a_fast_primary_is_never_hedged():
    primary = ScriptedUpstream.of(*text_script("fast"), name="a")
    backup = ScriptedUpstream.of(*text_script("backup"), name="b")
    notes: list[str] = []
    events = await _run(_hedge(primary, backup, delay_s=30.0, notes=notes))
    assert _text(events) == "fast" and isinstance(events[-1], Done)
    assert backup.calls == 0 and notes == []


async def test_a_stalled_primary_is_hedged_and_cancelled_when_the_backup_commits():
    primary = ScriptedUpstream.of(Stall(), name="a")
    backup = ScriptedUpstream.of(*text_script("backup"), name="b")
    notes: list[str] = []
    events = await _run(_hedge(primary, backup, notes=notes))
    assert _text(events) == "backup" and isinstance(events[-1], Done)
    assert primary.cancelled == 1 and primary.active == 0
    assert notes == ["started", "won"]
    assert _merged(events) == {"x-peer": "b", "x-mesh-hedge": "won"}


async def test_the_primary_may_still_win_after_the_hedge_started():
    primary = ScriptedUpstream.of(Sleep(0.05), *text_script("primary"), name="a")
    backup = ScriptedUpstream.of(Stall(), name="b")
    notes: list[str] = []
    events = await _run(_hedge(primary, backup, notes=notes))
    assert _text(events) == "primary"
    assert backup.calls == 1 and backup.cancelled == 1
    assert notes == ["started", "lost"]
    assert _merged(events)["x-mesh-hedge"] == "lost"


async def test_never_after_the_commit():
    primary = ScriptedUpstream.of(TextDelta("first"), Sleep(0.05), TextDelta(" rest"), Done("stop"), name="a")  # fmt: skip
    backup = ScriptedUpstream.of(*text_script("backup"), name="b")
    events = await _run(_hedge(primary, backup))
    assert _text(events) == "first rest"
    assert backup.calls == 0


async def test_not_when_the_mesh_is_overloaded():
    primary = ScriptedUpstream.of(Sleep(0.05), *text_script("slow"), name="a")
    backup = ScriptedUpstream.of(*text_script("backup"), name="b")
    events = await _run(_hedge(primary, backup, allow=lambda: False))
    assert _text(events) == "slow"
    assert backup.calls == 0


async def test_at_most_one_hedge_per_request_even_across_retries():
    primary = ScriptedUpstream.of(Sleep(0.05), *text_script("slow"), name="a")
    backup = ScriptedUpstream.of(Sleep(0.2), *text_script("backup"), name="b")
    hedged = _hedge(primary, backup)
    await _run(hedged)
    assert backup.calls == 1
    await _run(hedged)  # the router's retry of the same route
    assert backup.calls == 1


async def test_a_side_failing_before_the_commit_waits_for_the_other():
    busy = Error(kind="unavailable", message="busy", retryable=True)
    primary = ScriptedUpstream.of(Sleep(0.05), busy, name="a")
    backup = ScriptedUpstream.of(Sleep(0.1), *text_script("backup"), name="b")
    events = await _run(_hedge(primary, backup))
    assert _text(events) == "backup"
    assert not any(isinstance(e, Error) for e in events)


async def test_both_failing_passes_the_failure_on_for_the_router_to_retry():
    busy = Error(kind="unavailable", message="busy", retryable=True)
    primary = ScriptedUpstream.of(Sleep(0.05), busy, name="a")
    backup = ScriptedUpstream.of(busy, name="b")
    events = await _run(_hedge(primary, backup))
    assert events[-1].kind == "unavailable" and events[-1].retryable
    assert _text(events) == ""


async def test_through_the_router_the_winner_is_in_the_route_headers():
    primary = ScriptedUpstream.of(Stall(), name="a")
    backup = ScriptedUpstream.of(*text_script("backup"), name="b")
    route = Route(upstream=_hedge(primary, backup), kind="peer", peer="a", reason="cache 64/100")
    router = Router(StaticDirectory(), retry_backoff_s=0.001)
    events = [e async for e in router.stream(REQUEST, [route])]
    headers = _merged(events)
    assert headers["x-peer"] == "b" and headers["x-mesh-hedge"] == "won"
    assert headers["x-mesh-route-reason"] == "cache 64/100"
    assert primary.cancelled == 1
