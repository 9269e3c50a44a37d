"""``model="mesh"`` end to end: the real gateway over real workers running tiny MLX models."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.moa import MixtureOfAgents, MoaConfig
from gateway.testing import ServerThread
from gateway.upstream import ModelInfo, StaticDirectory
from gateway.worker_client import WorkerClient
from worker.engine.core import Engine
from worker.serve.app import create_app as create_worker_app

USER = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def mesh_gateway(tiny_think_model_dir, tiny_model_dir):
    """One gateway with two directories' worth of routes: ``think`` alone (self-mixture) is
    served at /solo, ``think`` + ``plain`` at /duo."""
    engines, servers = [], []
    try:
        upstreams = {}
        for name, path in (("think", tiny_think_model_dir), ("plain", tiny_model_dir)):
            engine = Engine(str(path), name=name)
            engine.start()
            engines.append(engine)
            server = ServerThread(create_worker_app(engine)).__enter__()
            servers.append(server)
            upstreams[name] = WorkerClient(server.url, name)
        solo, duo = StaticDirectory(), StaticDirectory()
        solo.add(ModelInfo("think", parameters=2), upstreams["think"])
        duo.add(ModelInfo("think", parameters=2), upstreams["think"])
        duo.add(ModelInfo("plain", parameters=1), upstreams["plain"])
        config = MoaConfig(
            race_min_tokens=2, first_token_timeout_s=60, total_timeout_s=120, judge_pick=True
        )
        with (
            ServerThread(create_app(solo, GatewayConfig(), moa=MixtureOfAgents(solo, config))) as a,
            ServerThread(create_app(duo, GatewayConfig(), moa=MixtureOfAgents(duo, config))) as b,
        ):
            yield a.url, b.url
    finally:
        for server in servers:
            server.__exit__(None, None, None)
        for engine in engines:
            engine.close()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url + "/v1", api_key="k", max_retries=0, _strict_response_validation=True
    )


def test_mesh_is_listed_and_answers_with_thinking_off_by_default(mesh_gateway):
    solo, _ = mesh_gateway
    with client(solo) as oai:
        assert "mesh" in [m.id for m in oai.models.list().data]
        chunks = list(
            oai.chat.completions.create(
                model="mesh", messages=USER, max_tokens=12, temperature=0.0, stream=True
            )
        )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        for c in chunks
        if c.choices
    )
    # The scripted think model says "Let me think" only when thinking is on.
    assert "The answer is 4." in text
    assert "Let me think" not in reasoning + text


def test_mesh_reasoning_opt_in_reaches_the_workers(mesh_gateway):
    solo, _ = mesh_gateway
    with client(solo) as oai:
        done = oai.chat.completions.create(
            model="mesh", messages=USER, max_tokens=20, temperature=0.0, reasoning_effort="high"
        )
    message = done.choices[0].message
    assert (message.model_extra or {}).get("reasoning_content", "").strip() == "Let me think"


def test_mesh_headers_name_policy_workers_and_winner(mesh_gateway):
    _, duo = mesh_gateway
    body = {"model": "mesh", "messages": USER, "max_tokens": 8, "stream": True, "temperature": 0}
    with httpx.stream("POST", duo + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        payload = response.read().decode()
    assert response.headers["x-moa-policy"] == "race"
    assert response.headers["x-moa-workers"] == "2"
    assert response.headers["x-moa-winner"] in ("think", "plain")
    assert payload.rstrip().endswith("data: [DONE]")


def test_judge_asks_the_strongest_model_to_pick_among_differing_answers(mesh_gateway):
    # think answers "The answer is 4."; plain's random weights say something else: the judge
    # (think, the larger) is asked, and its grammar-held reply names one of the two.
    _, duo = mesh_gateway
    body = {
        "model": "mesh",
        "messages": USER,
        "max_tokens": 8,
        "stream": True,
        "temperature": 0,
        "metadata": {"moa_policy": "judge", "moa_samples": "2"},
    }
    with httpx.stream("POST", duo + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        payload = response.read().decode()
    headers = response.headers
    assert headers["x-moa-policy"] == "judge" and headers["x-moa-workers"] == "2"
    assert headers["x-moa-options"] == "2" and headers["x-moa-decision"] == "judged"
    assert headers["x-moa-winner"] in ("think#0", "plain#1")
    assert payload.rstrip().endswith("data: [DONE]")
