"""Background Responses through the official SDK: queued at once, polled to the end, a stream
resumed with ``starting_after``, cancelled mid-generation, surviving the client's disconnect;
every object and event to the spec."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from openresponses import check_event, check_response, sse_events

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.events import Done, TextDelta, Usage
from gateway.testing import ScriptedUpstream, ServerThread, Sleep, Stall
from gateway.upstream import ModelInfo, StaticDirectory

pytestmark = pytest.mark.e2e

SLOW = [Sleep(0.3), *(TextDelta(w) for w in ("one ", "two ", "three")), Usage(3, 3), Done("stop")]


@pytest.fixture(scope="module")
def upstreams():
    return {
        "slow": ScriptedUpstream.of(*SLOW, delay_s=0.05),
        "stall": ScriptedUpstream.of(TextDelta("start "), Stall()),
    }


@pytest.fixture(scope="module")
def server(upstreams):
    directory = StaticDirectory()
    for name, upstream in upstreams.items():
        directory.add(ModelInfo(id=name), upstream)
    app = create_app(
        directory, GatewayConfig(retry_backoff_ms=1, keepalive_s=0.1, header_wait_s=0.05)
    )
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0) as client:
        yield client


def _poll(oai, response_id: str, until: set[str], timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = oai.responses.retrieve(response_id)
        if got.status in until:
            return got
        time.sleep(0.05)
    raise AssertionError(f"{response_id} never reached {until}")


def test_queued_at_once_then_polled_to_the_end(oai, server):
    created = oai.responses.create(model="slow", input="count", background=True)
    assert created.status == "queued" and created.background is True
    done = _poll(oai, created.id, {"completed"})
    assert done.output_text == "one two three" and done.background is True
    raw = httpx.get(f"{server.url}/v1/responses/{created.id}").json()
    check_response(raw)


def test_a_stream_resumes_after_a_sequence_number(server):
    body = {"model": "slow", "input": "count", "background": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body) as first:
        raw = b""
        for chunk in first.iter_bytes():
            raw += chunk
            if b"response.output_text.delta" in raw:
                break  # the client goes away mid-answer: the run goes on
    seen = sse_events(raw.rsplit(b"\n\n", 1)[0] + b"\n\n")
    assert [e["type"] for e in seen[:2]] == ["response.created", "response.queued"]
    assert seen[0]["response"]["status"] == "queued"
    last = seen[-1]["sequence_number"]
    response_id = seen[0]["response"]["id"]
    url = f"{server.url}/v1/responses/{response_id}?stream=true&starting_after={last}"
    rest = sse_events(httpx.get(url, timeout=10).content)
    assert rest[0]["sequence_number"] == last + 1
    events = seen + rest
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "one two three"
    for event in events:
        check_event(event)


def test_cancel_stops_the_generation(oai, upstreams):
    stall = upstreams["stall"]
    created = oai.responses.create(model="stall", input="go", background=True)
    _poll(oai, created.id, {"in_progress"})
    deadline = time.monotonic() + 5
    while not stall.active and time.monotonic() < deadline:
        time.sleep(0.02)
    cancelled = oai.responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    assert oai.responses.retrieve(created.id).status == "cancelled"
    deadline = time.monotonic() + 5
    while stall.active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stall.cancelled >= 1 and not stall.active


def test_a_poll_mid_generation_sees_the_output_so_far(oai, server):
    """While ``in_progress`` the polled object carries the output so far (as OpenAI's does):
    the open message with the text generated until now, its status ``in_progress``."""
    created = oai.responses.create(model="stall", input="go", background=True)
    deadline = time.monotonic() + 10
    raw: dict = {}
    while time.monotonic() < deadline:
        raw = httpx.get(f"{server.url}/v1/responses/{created.id}").json()
        if raw["status"] == "in_progress" and raw["output"]:
            break
        time.sleep(0.05)
    assert raw["status"] == "in_progress" and raw["output"], raw
    check_response(raw)
    (message,) = raw["output"]
    assert message["type"] == "message" and message["status"] == "in_progress"
    assert message["content"][0]["text"] == "start "
    assert oai.responses.retrieve(created.id).output_text == "start "
    oai.responses.cancel(created.id)


def test_what_cannot_be_done_in_the_background(oai, server):
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model="slow", input="x", background=True, store=False)
    foreground = oai.responses.create(model="slow", input="x")
    with pytest.raises(openai.BadRequestError):
        oai.responses.cancel(foreground.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.cancel("resp_gone")
    stream = httpx.get(f"{server.url}/v1/responses/{foreground.id}?stream=true")
    assert stream.status_code == 400


def test_keep_alives_are_in_progress_events_the_sdk_takes_in_stride(oai, server):
    """While the model prefills, the stream sends response.in_progress (an event: Codex counts
    nothing else as activity), and the SDK's stream helper still builds the whole answer."""
    body = {"model": "slow", "input": "count", "stream": True}
    events = sse_events(httpx.post(server.url + "/v1/responses", json=body, timeout=10).content)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.in_progress"]
    for event in events:
        check_event(event)
    with oai.responses.stream(model="slow", input="count") as stream:
        final = stream.get_final_response()
    assert final.output_text == "one two three"


def test_deleting_a_running_background_response_stops_it(oai, upstreams):
    stall = upstreams["stall"]
    cancelled = stall.cancelled
    created = oai.responses.create(model="stall", input="go", background=True)
    _poll(oai, created.id, {"in_progress"})
    oai.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(created.id)
    assert stall.cancelled == cancelled + 1
