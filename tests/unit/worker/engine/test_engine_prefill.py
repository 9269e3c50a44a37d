"""Engine: a job cancelled during its prefill stops within one chunk and keeps the KV of the
chunks it did, so the same prompt sent again resumes there and says the same (issue 13).

Chunks are counted on the model (``PrefillSpy``), never timed; the cancel lands as a chosen
chunk starts, on the engine's own thread, so the counts are exact."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from worker.chat.prompt import ChatTemplate
from worker.engine.core import Engine, Job
from worker.engine.types import EngineConfig, Finished, GenerationRequest
from worker.sampling import SamplingParams
from worker.testing import PrefillSpy, collect_logprobs, wait_until

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
    prompt, _ = ChatTemplate(engine.tokenizer).render([{"role": "user", "content": text}], None, {})
    assert len(prompt) >= tokens
    return prompt[:tokens]


async def run(engine: Engine, prompt: list[int]) -> tuple[list[tuple[str, float]], Finished]:
    """Greedy, to the end: each token with its logprob (equal logprobs: equal KV before it)."""
    job = engine.submit(GenerationRequest(prompt, 12, GREEDY, logprobs=True))
    return await collect_logprobs(engine, job)


async def cancel_during_chunk(engine: Engine, spy: PrefillSpy, prompt: list[int]) -> Job:
    """Submit ``prompt`` and cancel it as its CANCEL_AT-th prefill chunk starts (a client that
    leaves then); returns once the engine has dropped or finished the job."""
    submitted = threading.Event()
    jobs: list[Job] = []

    def on_chunk(n: int) -> None:
        if n == CANCEL_AT:
            assert submitted.wait(10)
            engine.cancel(jobs[0])

    spy.on_chunk = on_chunk
    jobs.append(engine.submit(GenerationRequest(prompt, 12, GREEDY)))
    submitted.set()
    job = jobs[0]
    await wait_until(lambda: {"cancelled", "finished"} & set(engine.stats.events_for(job.id)))
    spy.on_chunk = None
    return job


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "sequential"])
@pytest.mark.parametrize("window", [None, 8], ids=["full", "sliding"])
async def test_cancel_mid_prefill_stops_within_a_chunk_and_the_retry_resumes(
    tiny_model_dir: Path, sliding_model_dir: Path, batching: bool, window: int | None
) -> None:
    model_dir = sliding_model_dir if window else tiny_model_dir
    cold, engine = started(model_dir, batching), started(model_dir, batching)
    try:
        prompt = long_prompt(engine)
        expected, _ = await run(cold, prompt)  # the uninterrupted run
        spy = PrefillSpy.install(engine)

        job = await cancel_during_chunk(engine, spy, prompt)
        assert "cancelled" in engine.stats.events_for(job.id)
        assert spy.chunks == [STEP] * CANCEL_AT  # the chunk under way ends, no other starts
        assert "cache_kept" in engine.stats.events_for(job.id)
        assert engine.stats.queue_depth == 0 and engine.stats.in_flight == 0

        spy.reset()
        tokens, done = await run(engine, prompt)
        assert done.cached_tokens == CANCEL_AT * STEP
        assert sum(spy.chunks) == len(prompt) - 1 - CANCEL_AT * STEP  # only the rest ran
        assert tokens == expected
    finally:
        engine.close()
        cold.close()


async def test_a_longer_prompt_also_resumes_from_the_kept_prefix(tiny_model_dir: Path) -> None:
    """The agent's retry may carry more (a new user line): the kept chunks still serve it."""
    cold, engine = started(tiny_model_dir, True), started(tiny_model_dir, True)
    try:
        prompt = long_prompt(engine)
        longer = long_prompt(engine, PROMPT_TOKENS + STEP)
        expected, _ = await run(cold, longer)
        spy = PrefillSpy.install(engine)
        await cancel_during_chunk(engine, spy, prompt)
        tokens, done = await run(engine, longer)
        assert done.cached_tokens == CANCEL_AT * STEP
        assert tokens == expected
    finally:
        engine.close()
        cold.close()


async def test_a_job_cancelled_before_its_prefill_keeps_nothing_new(tiny_model_dir: Path) -> None:
    """Cancelled while still queued behind another prefill: its cache is a copy of a stored
    entry, which is not stored a second time."""
    engine = Engine(
        str(tiny_model_dir),
        config=EngineConfig(prefill_step_size=STEP, prefill_batch_size=1),  # one at a time
    )
    engine.start(timeout=60)
    try:
        prompt = long_prompt(engine)
        await run(engine, prompt)
        await wait_until(lambda: engine.stats.commits == 1)  # prompt and answer are stored
        entries = len(engine._store)
        spy = PrefillSpy.install(engine)
        submitted = threading.Event()
        queued: list[Job] = []

        def on_chunk(n: int) -> None:
            if n == 1:
                assert submitted.wait(10)
                engine.cancel(queued[0])

        spy.on_chunk = on_chunk
        other = engine.submit(GenerationRequest(long_prompt(engine, text="other"), 2, GREEDY))
        queued.append(engine.submit(GenerationRequest([*prompt, 5, 6], 12, GREEDY)))
        submitted.set()
        await wait_until(lambda: "cancelled" in engine.stats.events_for(queued[0].id))
        assert "cache_kept" not in engine.stats.events_for(queued[0].id)
        assert len(engine._store) == entries
        async for _ in other.events():
            pass
    finally:
        engine.close()


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
