"""Engine: a job cancelled during its prefill stops within one chunk and keeps the KV of the
chunks it did, so the same prompt sent again resumes there and says the same (issue 13).

Chunks are counted on the model (``PrefillSpy``), never timed; the cancel lands as a chosen
chunk starts, on the engine's own thread, so the counts are exact."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from worker.engine import Engine
from worker.engine_types import EngineConfig, Finished, GenerationRequest, TokenChunk
from worker.sampling import SamplingParams

# Greedy, and penalised: the penalties see the prompt's last tokens, which a resumed prefill
# must hand them as an uninterrupted one does.
GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5)
STEP = 16  # prefill_step_size: the prompt below is 9 chunks
PROMPT_TOKENS = 8 * STEP + 6  # all but the last token are prefilled: 8 full chunks and 5 tokens
CANCEL_AT = 3  # the chunk during which the client leaves


def started(model_dir: Path, batching: bool) -> Engine:
    engine = Engine(str(model_dir), config=EngineConfig(batching=batching, prefill_step_size=STEP))
    engine.start(timeout=60)
    return engine


def long_prompt(engine: Engine, tokens: int = PROMPT_TOKENS, text: str = "Line") -> list[int]:
    text = " ".join(f"{text} {i}: the quick brown fox jumps over the lazy dog." for i in range(40))
    prompt, _ = engine.render_prompt([{"role": "user", "content": text}], None, {})
    assert len(prompt) >= tokens
    return prompt[:tokens]


async def wait_until(predicate: Callable[[], bool], limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def run(engine: Engine, prompt: list[int]) -> tuple[list[tuple[str, float]], Finished]:
    """Greedy, to the end: each token with its logprob (equal logprobs: equal KV before it)."""
    job = engine.submit(GenerationRequest(prompt, 12, GREEDY, logprobs=True))
    tokens = []
    async for event in job.events():
        if isinstance(event, TokenChunk):
            tokens.extend(event.logprobs or [])
        else:
            assert isinstance(event, Finished), event
            engine.commit(job)
            return tokens, event
    raise AssertionError("no terminal event")


async def test_sequential_penalties_see_the_whole_prompt_as_batched_ones_do(
    tiny_model_dir: Path,
) -> None:
    """The sequential generator prefills by itself and hands generate_step only the last prompt
    token; the penalties must still see the prompt before it (as BatchGenerator's do)."""
    batched, sequential = started(tiny_model_dir, True), started(tiny_model_dir, False)
    try:
        prompt = long_prompt(batched)
        expected, _ = await run(batched, prompt)
        tokens, _ = await run(sequential, prompt)
        assert [t for t, _ in tokens] == [t for t, _ in expected]
        assert [lp for _, lp in tokens] == pytest.approx([lp for _, lp in expected], abs=1e-4)
    finally:
        batched.close()
        sequential.close()
