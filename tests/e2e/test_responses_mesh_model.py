"""``model="mesh"`` (mixture-of-agents over two scripted workers) on every part of Responses
state: the stored output is the winner's; continuation, background, WebSocket mode and
compaction all run through the arbiter."""

from __future__ import annotations

import time

import openai
import orjson
import pytest
import websockets.sync.client as ws_client
from openresponses import check_response

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.moa import MixtureOfAgents, MoaConfig
from gateway.testing import ScriptedUpstream, ServerThread, paced_script
from gateway.upstream import ModelInfo, StaticDirectory

pytestmark = pytest.mark.e2e
WINNER = "The sky is blue today."


@pytest.fixture(scope="module")
def workers():
    return {
        "quick": ScriptedUpstream.of(*paced_script(WINNER)),
        "slow": ScriptedUpstream.of(*paced_script("Too late.", ttft=0.5)),
    }


@pytest.fixture(scope="module")
def server(workers):
    directory = StaticDirectory()
    directory.add(ModelInfo("quick", parameters=1), workers["quick"])
    directory.add(ModelInfo("slow", parameters=2), workers["slow"])
    moa = MixtureOfAgents(directory, MoaConfig())
    with ServerThread(create_app(directory, GatewayConfig(), moa=moa)) as srv:
        yield srv


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0) as client:
        yield client


def test_the_stored_answer_is_the_winners_and_a_chain_reaches_every_worker(oai, workers):
    first = oai.responses.create(model="mesh", input="Sky?")
    stored = oai.responses.retrieve(first.id)
    assert stored.output_text.strip() == WINNER and stored.model == "mesh"
    check_response(oai.responses.with_raw_response.retrieve(first.id).http_response.json())
    oai.responses.create(model="mesh", input="And at night?", previous_response_id=first.id)
    for worker in workers.values():  # the arbiter fanned the whole history out
        roles = [m.role for m in worker.requests[-1].messages]
        assert roles == ["user", "assistant", "user"]
        assert worker.requests[-1].messages[1].content.strip() == WINNER


def test_background_and_compaction_run_through_the_arbiter(oai):
    created = oai.responses.create(model="mesh", input="Sky?", background=True)
    deadline = time.monotonic() + 10
    while (got := oai.responses.retrieve(created.id)).status != "completed":
        assert time.monotonic() < deadline, got.status
        time.sleep(0.05)
    assert got.output_text.strip() == WINNER
    # A long earlier answer: a conversation worth compacting (a short one comes back as it was).
    earlier = {
        "role": "assistant",
        "content": "The sky is blue because of Rayleigh scattering. " * 20,
    }
    compacted = oai.responses.with_raw_response.compact(
        model="mesh", previous_response_id=created.id, input=[earlier]
    ).http_response.json()
    assert [item["type"] for item in compacted["output"]] == ["message", "compaction"]


def test_websocket_turns_through_the_arbiter(server):
    url = server.url.replace("http://", "ws://") + "/v1/responses"
    with ws_client.connect(url) as socket:
        texts, ids = [], []
        for words, previous in (("Sky?", None), ("Night?", "first")):
            body = {"type": "response.create", "model": "mesh", "input": words}
            if previous:
                body["previous_response_id"] = ids[-1]
            socket.send(orjson.dumps(body).decode())
            text = ""
            while (event := orjson.loads(socket.recv()))["type"] != "response.completed":
                text += event.get("delta", "") if event["type"].endswith("text.delta") else ""
            texts.append(text.strip())
            ids.append(event["response"]["id"])
    assert texts == [WINNER, WINNER]
