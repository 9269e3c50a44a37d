"""The start-up warm-up: real requests through the worker app in-process, leaving no trace."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from worker.engine.core import Engine
from worker.serve.app import create_app
from worker.serve.warm_up import MESSAGES, warm_up

SECRET = "only-the-node-knows"


@pytest.fixture
def engine(fresh_engine: Engine) -> Engine:
    return fresh_engine


async def _first_user_request(app) -> dict:
    transport = httpx.ASGITransport(app=app)
    headers = {"authorization": f"Bearer {SECRET}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://w", headers=headers) as c:
        body = {"messages": MESSAGES, "max_tokens": 2}
        return (await c.post("/v1/chat/completions", json=body)).json()


def test_warm_up_generates_and_leaves_nothing_behind(engine: Engine) -> None:
    app = create_app(engine, secret=SECRET)  # the warm-up carries the worker's secret
    assert engine.stats.warm_up_s is None
    asyncio.run(warm_up(app, secret=SECRET, max_tokens=3))
    assert engine.stats.warm_up_s is not None and engine.stats.warm_up_tokens > 0
    assert engine.stats.submitted == engine.stats.completed == 2  # defaults + every filter
    # The first user sends exactly the warm-up's conversation, yet nothing of it is cached
    # (cached_tokens would report the warm-up as the user's) and it waits for no commit.
    reply = asyncio.run(_first_user_request(app))
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert engine.stats.commit_waits == 0
    assert "discarded" in engine.stats.events_for("")


def test_warm_up_tokens_do_not_count_as_load(engine: Engine) -> None:
    asyncio.run(warm_up(create_app(engine)))
    deadline = time.monotonic() + 30
    while engine.tokens_per_second() > 0:  # the discard runs on the engine's thread
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_failed_warm_up_is_an_engine_error(engine: Engine) -> None:
    from worker.engine.core import EngineError

    with pytest.raises(EngineError, match="401"):  # e.g. the wrong secret
        asyncio.run(warm_up(create_app(engine, secret=SECRET), secret="wrong"))
    assert engine.stats.warm_up_s is None
