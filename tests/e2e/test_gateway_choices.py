"""Chat ``n > 1`` and ``model="mesh"`` on a one-model node, through the real gateway and the real
worker (tiny MLX model, HTTP on loopback), with the openai SDK: every choice is there with its
index, usage counts the prompt once, and the samples of one prompt cost one prefill (the worker's
/health says so)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from gateway.config import GatewayConfig
from gateway.moa import MixtureOfAgents, MoaConfig
from gateway.testing import gateway_over_worker

# Long enough that the samples wait for one prefill rather than each doing its own.
QUESTION = " ".join(f"Fact {i}: the river Nile flows north into the sea." for i in range(12))


@pytest.fixture(scope="module")
def node(tiny_model_dir):
    with gateway_over_worker(
        tiny_model_dir,
        "plain",
        config=GatewayConfig(retry_backoff_ms=1),
        make_moa=lambda directory: MixtureOfAgents(directory, MoaConfig(max_workers=3)),
    ) as front:
        yield front


@pytest.fixture
def oai(node):
    with openai.OpenAI(
        base_url=node.url + "/v1", api_key="k", _strict_response_validation=True, max_retries=0
    ) as client:
        yield client


def prefills(node) -> int:
    return httpx.get(node.worker_url + "/health", timeout=10).json()["prefill"]["prefills"]


def ask(text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_n3_greedy_is_three_copies_of_one_answer_for_one_prefill(node, oai) -> None:
    single = oai.chat.completions.create(
        model="plain", messages=ask("Once: " + QUESTION), max_tokens=12, temperature=0
    )
    before = prefills(node)
    completion = oai.chat.completions.create(
        model="plain", messages=ask("Once: " + QUESTION), max_tokens=12, temperature=0, n=3
    )
    # The single request's prompt was cached, so the three ran no prefill of the prompt at all
    # beyond its tail; a fresh prompt below shows the one prefill.
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert {c.message.content for c in completion.choices} == {single.choices[0].message.content}
    usage = completion.usage
    assert usage.prompt_tokens == single.usage.prompt_tokens
    assert usage.completion_tokens == 3 * single.usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert prefills(node) - before <= 1

    before = prefills(node)
    fresh = oai.chat.completions.create(
        model="plain", messages=ask("Fresh: " + QUESTION), max_tokens=12, temperature=0, n=3
    )
    assert prefills(node) - before == 1
    assert len({c.message.content for c in fresh.choices}) == 1


def test_n3_streamed_tags_every_chunk_and_sums_usage(node, oai) -> None:
    before = prefills(node)
    stream = oai.chat.completions.create(
        model="plain",
        messages=ask("Streamed: " + QUESTION),
        max_tokens=10,
        temperature=0,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2] and len(set(texts.values())) == 1
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 30
    assert prefills(node) - before == 1


def test_n3_sampled_choices_differ_and_choice_zero_is_the_seeded_single(oai) -> None:
    fields = {"model": "plain", "max_tokens": 16, "temperature": 1.0, "seed": 11}
    single = oai.chat.completions.create(messages=ask("Seeded: " + QUESTION), **fields)
    completion = oai.chat.completions.create(messages=ask("Seeded: " + QUESTION), n=3, **fields)
    texts = [c.message.content for c in completion.choices]
    assert texts[0] == single.choices[0].message.content
    assert len(set(texts)) == 3


def test_mesh_self_mixture_costs_one_prefill(node, oai) -> None:
    before = prefills(node)
    completion = oai.chat.completions.create(
        model="mesh", messages=ask("Mesh: " + QUESTION), max_tokens=8, temperature=0
    )
    assert completion.choices[0].message.content
    assert prefills(node) - before == 1


def test_a_client_leaving_an_n3_stream_cancels_every_choice(node, oai) -> None:
    engine = node.engine
    before = engine.stats.cancelled
    stream = oai.chat.completions.create(
        model="plain", messages=ask("Leave: " + QUESTION), max_tokens=3000, n=3, stream=True
    )
    seen: set[int] = set()
    for chunk in stream:
        seen.update(c.index for c in chunk.choices if c.delta.content)
        if len(seen) == 3:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while engine.stats.cancelled < before + 3 or engine.stats.in_flight:
        assert time.monotonic() < deadline, "the choices kept running"
        time.sleep(0.05)
    assert engine.stats.cancelled == before + 3 and engine.stats.queue_depth == 0


def test_n_above_the_limit_is_a_400_naming_it(oai) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="plain", messages=ask(), max_tokens=2, n=17)
    assert "n" in str(caught.value)
