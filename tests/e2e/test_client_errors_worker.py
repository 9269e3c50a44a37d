"""Client mistakes that only the real worker used to catch, badly: template kwargs that collide
with the template call and out-of-range seeds were 500s there and 502s through the gateway;
``logit_bias`` was dropped by the gateway. A tiny MLX model, both servers on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.testing import ServerThread
from gateway.upstream import ModelInfo, StaticDirectory
from gateway.worker_client import WorkerClient
from worker.engine.core import Engine
from worker.testing import run_worker_in_thread

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def worker(tiny_model_dir: Path) -> Iterator[tuple[str, Engine]]:
    with run_worker_in_thread(tiny_model_dir, name="tiny") as served:
        yield served


@pytest.fixture(scope="module")
def gateway(worker: tuple[str, Engine]) -> Iterator[str]:
    directory = StaticDirectory()
    directory.add(ModelInfo(id="tiny"), WorkerClient(worker[0].removesuffix("/v1"), "tiny"))
    with ServerThread(create_app(directory, GatewayConfig(retry_backoff_ms=1))) as front:
        yield front.url


def _chat(base: str, **fields: Any) -> httpx.Response:
    body = {"model": "tiny", "messages": HI, "max_tokens": 6, **fields}
    return httpx.post(f"{base.removesuffix('/v1')}/v1/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize("key", ["tokenize", "add_generation_prompt", "conversation"])
@pytest.mark.parametrize("front", ["worker", "gateway"])
def test_template_kwargs_that_collide_with_the_call_are_400(
    request: pytest.FixtureRequest, front: str, key: str
) -> None:
    served = request.getfixturevalue(front)
    base = served[0] if front == "worker" else served
    response = _chat(base, chat_template_kwargs={key: False})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template_kwargs" and repr(key) in error["message"]


@pytest.mark.parametrize("front", ["worker", "gateway"])
def test_a_negative_seed_is_the_same_as_its_unsigned_twin(
    request: pytest.FixtureRequest, front: str
) -> None:
    served = request.getfixturevalue(front)
    base = served[0] if front == "worker" else served
    negative = _chat(base, seed=-1, temperature=1.0)
    assert negative.status_code == 200, negative.text
    twin = _chat(base, seed=2**64 - 1, temperature=1.0)
    if front == "worker":  # the gateway keeps OpenAI's int64 range; the worker takes uint64 too
        assert twin.status_code == 200, twin.text
        assert (
            negative.json()["choices"][0]["message"]["content"]
            == twin.json()["choices"][0]["message"]["content"]
        )
    else:
        assert twin.status_code == 400 and twin.json()["error"]["param"] == "seed"


def test_seeds_outside_the_workers_range_are_400(worker: tuple[str, Engine]) -> None:
    for seed in (2**64, -(2**63) - 1):
        response = _chat(worker[0], seed=seed)
        assert response.status_code == 400 and response.json()["error"]["param"] == "seed"


def test_logit_bias_reaches_the_model_through_the_gateway(
    worker: tuple[str, Engine], gateway: str
) -> None:
    tokenizer = worker[1].tokenizer
    token = tokenizer.encode("the", add_special_tokens=False)[0]
    piece = tokenizer.decode([token])
    plain = _chat(gateway, temperature=0)
    biased = _chat(gateway, temperature=0, logit_bias={str(token): 100})
    assert plain.status_code == biased.status_code == 200, biased.text
    assert plain.json()["choices"][0]["message"]["content"] != piece * 6
    assert biased.json()["choices"][0]["message"]["content"] == piece * 6


def test_logit_bias_outside_the_vocabulary_is_400_through_the_gateway(
    worker: tuple[str, Engine], gateway: str
) -> None:
    vocab = len(worker[1].tokenizer)
    response = _chat(gateway, logit_bias={str(vocab + 5): 1})
    assert response.status_code == 400, response.text
    assert "logit_bias" in response.json()["error"]["message"]
