"""Engine: samples of one prompt submitted together cost one prefill; each still says what a
single request says (greedy) or its own thing (sampled), and each is cancelled on its own.

Prefill work is counted on the model (``PrefillSpy``: forward passes over more than one token)
and in the engine's stats, never timed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from worker.chat.prompt import ChatTemplate
from worker.engine.core import Engine, Job
from worker.engine.types import EngineConfig, GenerationRequest
from worker.sampling import SamplingParams
from worker.testing import PrefillSpy, collect_logprobs, wait_until

GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.2)
STEP = 16  # prefill_step_size: the prompt below takes several chunks


def started(model_dir: Path, *, batching: bool = True, share: bool = True) -> Engine:
    config = EngineConfig(batching=batching, prefill_step_size=STEP, share_prefill=share)
    engine = Engine(str(model_dir), config=config)
    engine.start(timeout=60)
    return engine


def prompt_of(engine: Engine, text: str = "Tell me about rivers") -> list[int]:
    text = " ".join(f"{text}, part {i}: the quick brown fox jumps over the dog." for i in range(6))
    tokens, _ = ChatTemplate(engine.tokenizer).render([{"role": "user", "content": text}], None, {})
    assert len(tokens) > 3 * STEP
    return tokens


def same_answer(tokens: list[tuple[str, float]], expected: list[tuple[str, float]]) -> bool:
    """The same tokens, logprobs equal up to float rounding: a batch of several rows runs its
    matmuls in other blocks than one row does, and some BLAS kernels (OpenBLAS on Intel) then
    round the last bits differently. A wrong KV moves a logprob by far more than 1e-4."""
    return [t for t, _ in tokens] == [t for t, _ in expected] and np.allclose(
        [lp for _, lp in tokens], [lp for _, lp in expected], rtol=0, atol=1e-4
    )


def request(prompt: list[int], sampling: SamplingParams = GREEDY, n: int = 10) -> GenerationRequest:
    return GenerationRequest(prompt, n, sampling, logprobs=True)


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "sequential"])
@pytest.mark.parametrize("window", [None, 8], ids=["full", "sliding"])
async def test_three_samples_cost_one_prefill_and_say_what_one_request_says(
    tiny_model_dir: Path, sliding_model_dir: Path, batching: bool, window: int | None
) -> None:
    model_dir = sliding_model_dir if window else tiny_model_dir
    cold, engine = started(model_dir, batching=batching), started(model_dir, batching=batching)
    try:
        prompt = prompt_of(engine)
        expected, _ = await collect_logprobs(cold, cold.submit(request(prompt)))  # a single request
        spy = PrefillSpy.install(engine)
        before = engine.stats.prefills

        jobs = [engine.submit(request(prompt)) for _ in range(3)]
        results = await asyncio.gather(*(collect_logprobs(engine, job) for job in jobs))

        assert engine.stats.prefills - before == 1
        assert sum(spy.chunks) == len(prompt) - 1  # the prompt ran through the model once
        assert engine.stats.shared_prefills == 2
        assert engine.stats.shared_prefill_tokens == 2 * (len(prompt) - 1)
        for tokens, done in results:
            assert same_answer(tokens, expected)
            assert done.prompt_tokens == len(prompt)
        assert [done.cached_tokens for _, done in results] == [0, len(prompt) - 1, len(prompt) - 1]
        assert engine.stats.queue_depth == 0 and engine.stats.in_flight == 0
    finally:
        engine.close()
        cold.close()


async def test_sampled_siblings_differ_and_each_matches_its_seed_alone(
    tiny_model_dir: Path,
) -> None:
    cold, engine = started(tiny_model_dir), started(tiny_model_dir)
    try:
        prompt = prompt_of(engine)

        def sampled(seed: int) -> GenerationRequest:
            return request(prompt, SamplingParams(temperature=1.0, seed=seed), n=16)

        alone = [(await collect_logprobs(cold, cold.submit(sampled(s))))[0] for s in (1, 2)]
        before = engine.stats.prefills
        results = await asyncio.gather(
            *(collect_logprobs(engine, engine.submit(sampled(s))) for s in (1, 2))
        )
        assert engine.stats.prefills - before == 1
        outputs = [[text for text, _ in tokens] for tokens, _ in results]
        assert outputs[0] != outputs[1]
        assert outputs == [[text for text, _ in tokens] for tokens in alone]
    finally:
        engine.close()
        cold.close()


async def test_without_sharing_each_sample_prefills(tiny_model_dir: Path) -> None:
    """The baseline the shared prefill removes (and proof the counter counts)."""
    engine = started(tiny_model_dir, share=False)
    try:
        prompt = prompt_of(engine)
        await asyncio.gather(
            *(collect_logprobs(engine, engine.submit(request(prompt))) for _ in range(3))
        )
        assert engine.stats.prefills == 3 and engine.stats.shared_prefills == 0
    finally:
        engine.close()


async def test_a_prefix_shared_prompt_waits_and_runs_only_its_own_tail(
    tiny_model_dir: Path,
) -> None:
    cold, engine = started(tiny_model_dir), started(tiny_model_dir)
    try:
        prompt = prompt_of(engine)
        longer = [*prompt[:-1], *prompt_of(engine, "And lakes")[-8:]]
        expected, _ = await collect_logprobs(cold, cold.submit(request(longer)))
        spy = PrefillSpy.install(engine)
        first, second = engine.submit(request(prompt)), engine.submit(request(longer))
        (_, done_first), (tokens, done) = await asyncio.gather(
            collect_logprobs(engine, first), collect_logprobs(engine, second)
        )
        assert "follows" in engine.stats.events_for(second.id)
        assert done.cached_tokens == len(prompt) - 1
        assert sum(spy.chunks) == (len(prompt) - 1) + (len(longer) - done.cached_tokens - 1)
        assert same_answer(tokens, expected)
        assert done_first.cached_tokens == 0
    finally:
        engine.close()
        cold.close()


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "sequential"])
async def test_cancelling_the_source_mid_prefill_leaves_its_siblings_running(
    tiny_model_dir: Path, batching: bool
) -> None:
    """The first sample (whose prefill the others wait for) is cancelled during its second
    chunk: the others still finish, with a single request's tokens, and the chunks the
    cancelled one did are not run again."""
    cold, engine = (
        started(tiny_model_dir, batching=batching),
        started(tiny_model_dir, batching=batching),
    )
    try:
        prompt = prompt_of(engine)
        expected, _ = await collect_logprobs(cold, cold.submit(request(prompt)))
        spy = PrefillSpy.install(engine)
        jobs: list[Job] = []

        def on_chunk(n: int) -> None:
            if n == 2:
                engine.cancel(jobs[0])

        spy.on_chunk = on_chunk
        jobs.extend(engine.submit(request(prompt)) for _ in range(3))
        results = await asyncio.gather(*(collect_logprobs(engine, job) for job in jobs[1:]))
        spy.on_chunk = None
        assert "cancelled" in engine.stats.events_for(jobs[0].id)
        assert all(same_answer(tokens, expected) for tokens, _ in results)
        assert sum(spy.chunks) == len(prompt) - 1  # the cancelled one's chunks were kept
        assert engine.stats.queue_depth == 0 and engine.stats.in_flight == 0
    finally:
        engine.close()
        cold.close()


async def test_cancelling_a_follower_leaves_the_others(tiny_model_dir: Path) -> None:
    engine = started(tiny_model_dir)
    try:
        prompt = prompt_of(engine)
        jobs = [engine.submit(request(prompt, n=30)) for _ in range(3)]
        await wait_until(lambda: "follows" in engine.stats.events_for(jobs[1].id))
        engine.cancel(jobs[1])
        results = await asyncio.gather(
            collect_logprobs(engine, jobs[0]), collect_logprobs(engine, jobs[2])
        )
        assert [done.completion_tokens for _, done in results] == [30, 30]
        assert "cancelled" in engine.stats.events_for(jobs[1].id)
        assert "admitted" not in engine.stats.events_for(jobs[1].id)  # it never ran
        assert engine.stats.queue_depth == 0 and engine.stats.in_flight == 0
    finally:
        engine.close()


async def test_a_sample_arriving_while_its_sibling_decodes_forks_at_once(
    tiny_model_dir: Path,
) -> None:
    """The sibling already holds the prompt (and tokens after it): the copy is trimmed back."""
    cold, engine = started(tiny_model_dir), started(tiny_model_dir)
    try:
        prompt = prompt_of(engine)
        expected, _ = await collect_logprobs(cold, cold.submit(request(prompt)))
        first = engine.submit(request(prompt, n=200))
        seen = 0
        async for _ in first.events():
            seen += 1
            if seen == 5:
                break
        before = engine.stats.prefills
        tokens, done = await collect_logprobs(engine, engine.submit(request(prompt)))
        assert engine.stats.prefills == before
        assert done.cached_tokens == len(prompt) - 1
        # Decoded in one batch with a sibling at another position: the same tokens, logprobs
        # equal up to float rounding (the batch's padded attention sums in another order).
        assert [text for text, _ in tokens] == [text for text, _ in expected]
        assert [lp for _, lp in tokens] == pytest.approx([lp for _, lp in expected], abs=1e-4)
        engine.cancel(first)
    finally:
        engine.close()
        cold.close()
