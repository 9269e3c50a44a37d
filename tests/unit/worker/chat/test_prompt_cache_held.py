"""``POST /v1/prompt_cache/held``: what the worker holds of a prompt now, a pending commit
included, with its load and measured prefill rate (the mesh's routing-time question)."""

from __future__ import annotations

import httpx
import pytest

from worker.chat.prompt import ChatTemplate
from worker.engine.core import Engine
from worker.engine.types import Finished, GenerationRequest
from worker.prompt_cache.digest import block_hashes
from worker.sampling import SamplingParams
from worker.serve.app import create_app
from worker.testing import wait_until

SECRET = "only-the-node-knows"
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture
def engine(fresh_engine: Engine) -> Engine:
    return fresh_engine


async def _held(app, body: object) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    headers = {"authorization": f"Bearer {SECRET}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://w", headers=headers) as c:
        return await c.post("/v1/prompt_cache/held", json=body)


async def test_a_pending_commit_counts_as_held_until_it_lands(engine: Engine) -> None:
    app = create_app(engine, secret=SECRET)
    text = " ".join(f"word{i}" for i in range(200))
    prompt, _ = ChatTemplate(engine.tokenizer).render([{"role": "user", "content": text}], None, {})  # fmt: skip
    assert len(prompt) > 128
    job = engine.submit(GenerationRequest(prompt, 8, GREEDY))
    tokens = None
    async for event in job.events():
        if isinstance(event, Finished):
            tokens = event
    assert tokens is not None
    # The answer is out, its cache not committed: the next turn's prompt (the whole turn and
    # more) is held as pending, not yet as cached.
    next_turn = [*prompt, *range(7, 200)]
    question = {"block_size": 64, "hashes": block_hashes(next_turn, 64)}
    before = (await _held(app, question)).json()
    assert before["cached_tokens"] == 0
    assert before["pending_tokens"] >= (len(prompt) // 64) * 64
    assert before["prefill_tok_s"] > 0  # measured on this prefill
    assert before["queue_depth"] == 0 and before["prefill_backlog"] == 0
    engine.commit(job)
    await wait_until(lambda: engine.stats.commits == 1)
    after = (await _held(app, question)).json()
    assert after["cached_tokens"] == before["pending_tokens"] and after["pending_tokens"] == 0
    assert after["memory_tokens"] == after["cached_tokens"] and after["disk_tokens"] == 0
    assert after["restore_tok_s"] is None  # no disk tier here
    # Another block size says nothing rather than something wrong.
    other = (await _held(app, {"block_size": 32, "hashes": block_hashes(next_turn, 32)})).json()
    assert other["cached_tokens"] == other["pending_tokens"] == 0


@pytest.mark.parametrize(
    "body",
    [{"block_size": 64}, {"block_size": 64, "hashes": "x"}, {"block_size": "a", "hashes": []},
     {"block_size": 64, "hashes": list(range(20000))}, [1, 2]],
)  # fmt: skip
async def test_a_question_it_cannot_read_is_a_400(engine: Engine, body: object) -> None:
    response = await _held(create_app(engine, secret=SECRET), body)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
