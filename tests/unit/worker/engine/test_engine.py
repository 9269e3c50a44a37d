"""Engine on the tiny real models: batching, seeds, stops, cancel, prompt cache and its commit,
the model's sampling defaults."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.chat.prompt import ChatTemplate
from worker.engine.core import Engine, Job
from worker.engine.types import EngineConfig, Finished, GenerationRequest, TokenChunk
from worker.generation_config import MLX_LM_DEFAULTS
from worker.prompt_cache.store import PromptCacheStore, common_prefix
from worker.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    engine = Engine(str(tiny_model_dir), name="tiny")
    engine.start(timeout=60)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def think_engine(tiny_think_model_dir: Path) -> Iterator[Engine]:
    engine = Engine(str(tiny_think_model_dir), name="tiny-think")
    engine.start(timeout=60)
    yield engine
    engine.close()


def prompt_of(engine: Engine, text: str, **kwargs: object) -> list[int]:
    tokens, _ = ChatTemplate(engine.tokenizer).render(
        [{"role": "user", "content": text}], None, dict(kwargs)
    )
    return tokens


async def run(
    engine: Engine, request: GenerationRequest, *, commit: bool = True
) -> tuple[Job, str, Finished]:
    """Run a job to its end; commit its cache like the HTTP layer does (unless told not to)."""
    job = engine.submit(request)
    text = []
    async for event in job.events():
        if isinstance(event, TokenChunk):
            text.append(event.text)
        else:
            assert isinstance(event, Finished), event
            if commit:
                engine.commit(job)
            return job, "".join(text), event
    raise AssertionError("no terminal event")


async def wait_until(predicate: Callable[[], bool], limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_greedy_runs_to_max_tokens(engine: Engine) -> None:
    prompt = prompt_of(engine, "Hello")
    _, text, done = await run(engine, GenerationRequest(prompt, max_tokens=7, sampling=GREEDY))
    assert done.finish_reason == "length"
    assert done.completion_tokens == 7
    assert done.prompt_tokens == len(prompt)
    assert text


async def test_scripted_model_stops_at_eos(think_engine: Engine) -> None:
    prompt = prompt_of(think_engine, "Hi", enable_thinking=False)
    _, text, done = await run(think_engine, GenerationRequest(prompt, 50, GREEDY))
    assert text == "The answer is 4."
    assert done.finish_reason == "stop"
    assert done.stop_sequence is None  # EOS is not a stop string


async def test_stop_string_split_across_tokens(think_engine: Engine) -> None:
    prompt = prompt_of(think_engine, "Hi", enable_thinking=False)
    # "swer i" spans three tokens (" answer", " is"); none of it may be emitted.
    request = GenerationRequest(prompt, 50, GREEDY, stop=("swer i",))
    _, text, done = await run(think_engine, request)
    assert (text, done.finish_reason) == ("The an", "stop")
    assert done.completion_tokens == 3
    assert done.stop_sequence == "swer i"


async def test_seeded_sampling_is_deterministic(engine: Engine) -> None:
    prompt = prompt_of(engine, "Tell me a story")

    def request(seed: int) -> GenerationRequest:
        return GenerationRequest(prompt, 24, SamplingParams(temperature=1.0, seed=seed))

    first = await run(engine, request(7))
    second = await run(engine, request(7))
    other = await run(engine, request(8))
    assert first[1] == second[1]
    assert first[1] != other[1]


async def test_concurrent_jobs_are_batched_and_match_solo_runs(engine: Engine) -> None:
    prompts = [prompt_of(engine, f"question number {i}") for i in range(8)]
    solo = [(await run(engine, GenerationRequest(p, 12, GREEDY)))[1] for p in prompts[:2]]
    results = await asyncio.gather(
        *(run(engine, GenerationRequest(p, 12, GREEDY)) for p in prompts)
    )
    assert all(done.completion_tokens == 12 for _, _, done in results)
    assert [text for _, text, _ in results[:2]] == solo
    assert engine.stats.in_flight == 0 and engine.stats.queue_depth == 0


async def test_requests_that_reach_an_idle_engine_together_prefill_as_one_batch(
    tiny_model_dir: Path,
) -> None:
    """Requests sent at once reach the engine a few ms apart; an idle engine that started the
    first's prefill at once made the others wait a whole prefill for theirs. Here they come
    10 ms apart (the gap is widened so a loaded machine cannot split them) and prefill in one
    pass."""
    from worker.testing import PrefillSpy

    config = EngineConfig(admit_gap_s=0.25, admit_window_s=2.0)
    engine = Engine(str(tiny_model_dir), config=config)
    engine.start(timeout=60)
    try:
        spy = PrefillSpy.install(engine)
        jobs = []
        for i in range(3):
            prompt = prompt_of(engine, f"request {i} of three, " + "long " * (i * 3))
            jobs.append(asyncio.ensure_future(run(engine, GenerationRequest(prompt, 4, GREEDY))))
            await asyncio.sleep(0.01)
        await asyncio.gather(*jobs)
        assert spy.rows[0] == 3, spy.rows
    finally:
        engine.close()


async def test_cancel_stops_generation(engine: Engine) -> None:
    before = engine.stats.cancelled
    job = engine.submit(GenerationRequest(prompt_of(engine, "go on forever"), 3000, GREEDY))
    seen = 0
    async for event in job.events():
        assert isinstance(event, TokenChunk)
        seen += 1
        if seen == 3:
            break
    engine.cancel(job)
    await wait_until(lambda: engine.stats.cancelled == before + 1 and engine.stats.in_flight == 0)
    generated = engine.stats.generated_tokens
    await asyncio.sleep(0.2)
    assert engine.stats.generated_tokens == generated  # nothing runs any more
    assert generated < 3000


async def test_a_cancelled_job_leaves_its_prompt_cached(engine: Engine) -> None:
    """An agent harness that interrupts a reply and sends the conversation again skips the
    prefill of everything the interrupted job had processed."""
    prompt = prompt_of(engine, "a long conversation that gets interrupted")
    job = engine.submit(GenerationRequest(prompt, 3000, GREEDY))
    async for _ in job.events():
        break  # the first token: the prompt is in the cache now
    engine.cancel(job)
    await wait_until(lambda: "cache_kept" in engine.stats.events_for(job.id))
    _, _, done = await run(engine, GenerationRequest([*prompt, 7, 8], 3, GREEDY))
    assert done.cached_tokens >= len(prompt)


async def test_second_turn_reuses_committed_prefix(think_engine: Engine) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    kwargs = {"enable_thinking": False}
    first_prompt, _ = ChatTemplate(think_engine.tokenizer).render(messages, None, kwargs)
    _, text, _ = await run(think_engine, GenerationRequest(first_prompt, 50, GREEDY))
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And 3+3?"}]
    second_prompt, _ = ChatTemplate(think_engine.tokenizer).render(messages, None, kwargs)
    _, _, second = await run(think_engine, GenerationRequest(second_prompt, 50, GREEDY))
    # The template drops the empty think block from history: reuse runs up to where they differ.
    shared = common_prefix(first_prompt, second_prompt)
    assert shared > 0
    assert second.cached_tokens == shared


async def test_whole_first_turn_reused_when_history_renders_the_same(
    tiny_tool_model_dir: Path,
) -> None:
    engine = Engine(str(tiny_tool_model_dir))
    engine.start(timeout=60)
    try:
        messages = [{"role": "user", "content": "Weather?"}]
        first_prompt, _ = ChatTemplate(engine.tokenizer).render(messages, None, {})
        _, text, done = await run(engine, GenerationRequest(first_prompt, 50, GREEDY))
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Thanks"}]
        second_prompt, _ = ChatTemplate(engine.tokenizer).render(messages, None, {})
        _, _, second = await run(engine, GenerationRequest(second_prompt, 50, GREEDY))
        # Prompt and every generated token (the last one, <|im_end|>, included) were cached.
        assert second.cached_tokens == len(first_prompt) + done.completion_tokens
        assert second.cached_tokens < second.prompt_tokens
    finally:
        engine.close()


async def test_next_request_waits_for_pending_commit(tiny_think_model_dir: Path) -> None:
    engine = Engine(str(tiny_think_model_dir), config=EngineConfig(commit_wait_s=300))
    engine.start(timeout=60)
    try:
        prompt = prompt_of(engine, "Remember this long question please", enable_thinking=False)
        job, _, _ = await run(engine, GenerationRequest(prompt, 50, GREEDY), commit=False)
        follow_up = GenerationRequest([*prompt, *prompt_of(engine, "more")], 50, GREEDY)
        second = engine.submit(follow_up)
        await wait_until(lambda: engine.stats.commit_waits == 1)
        assert "admitted" not in engine.stats.events_for(second.id)  # parked, not running
        engine.commit(job)
        events = [e async for e in second.events()]
        done = events[-1]
        assert isinstance(done, Finished)
        assert done.cached_tokens >= len(prompt)
        order = [kind for kind, jid in engine.stats.events if jid in (job.id, second.id)]
        assert order.index("committed") < order.index("admitted", order.index("parked"))
        assert engine.stats.commit_wait_timeouts == 0
    finally:
        engine.close()


async def test_wait_for_commit_is_bounded(tiny_think_model_dir: Path) -> None:
    engine = Engine(str(tiny_think_model_dir), config=EngineConfig(commit_wait_s=0.2))
    engine.start(timeout=60)
    try:
        prompt = prompt_of(engine, "Question", enable_thinking=False)
        await run(engine, GenerationRequest(prompt, 50, GREEDY), commit=False)
        _, _, done = await run(engine, GenerationRequest([*prompt, 5, 6], 5, GREEDY))
        assert engine.stats.commit_wait_timeouts == 1
        assert done.cached_tokens == 0  # proceeded without the cache
    finally:
        engine.close()


async def test_bad_model_path_fails_to_start(tmp_path: Path) -> None:
    from worker.engine.core import EngineError

    engine = Engine(str(tmp_path / "missing"))
    with pytest.raises(EngineError):
        engine.start(timeout=60)


def test_prompt_cache_store_trims_evicts_and_copies(tiny_model_dir: Path) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    def cache_for(n: int) -> list[KVCache]:
        cache = KVCache()
        cache.update_and_fetch(mx.zeros((1, 2, n, 8)), mx.zeros((1, 2, n, 8)))
        return [cache]

    store = PromptCacheStore(max_bytes=10**9)
    store.insert([1, 2, 3, 4], cache_for(4))
    cache, n = store.fetch([1, 2, 3, 9, 9])
    assert n == 3 and cache is not None and cache[0].offset == 3
    # The stored entry is untouched by the trim of the copy.
    cache, n = store.fetch([1, 2, 3, 4, 5])
    assert n == 4 and cache[0].offset == 4
    # At least one prompt token is always left to run.
    assert store.fetch([1, 2, 3, 4])[1] == 3
    assert store.fetch([7, 8])[1] == 0
    # An entry that extends another replaces it.
    store.insert([1, 2, 3, 4, 5, 6], cache_for(6))
    assert len(store) == 1
    # Bytes bound: the least recently used entry goes.
    one = cache_for(6)[0].nbytes
    small = PromptCacheStore(max_bytes=one * 2)
    for start in (10, 20, 30):
        small.insert([start, start + 1, start + 2, 1, 1, 1], cache_for(6))
    assert len(small) == 2 and small.stats.evictions == 1
    assert small.fetch([10, 11, 12, 1, 1, 1, 1])[1] == 0


async def test_sequential_mode_serves_in_arrival_order(tiny_think_model_dir: Path) -> None:
    """Models whose cache cannot be batched are served one job at a time, same results."""
    engine = Engine(str(tiny_think_model_dir), config=EngineConfig(batching=False))
    engine.start(timeout=60)
    try:
        assert not engine.batchable
        prompt = prompt_of(engine, "Hi", enable_thinking=False)
        results = await asyncio.gather(
            *(run(engine, GenerationRequest(prompt, 50, GREEDY)) for _ in range(3))
        )
        assert [text for _, text, _ in results] == ["The answer is 4."] * 3
        admitted = [kind for kind, _ in engine.stats.events if kind in ("admitted", "finished")]
        assert admitted[-1] == "finished"
        # Stop strings, prompt reuse and cancel work the same way.
        _, text, done = await run(engine, GenerationRequest(prompt, 50, GREEDY, stop=(" is",)))
        assert (text, done.finish_reason) == ("The answer", "stop")
        assert done.cached_tokens > 0
        eos = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
        endless = SamplingParams(temperature=0.0, logit_bias={eos: -1000.0})
        job = engine.submit(GenerationRequest(prompt_of(engine, "long"), 3000, endless))
        async for _ in job.events():
            break  # it is running
        engine.cancel(job)
        await wait_until(lambda: engine.stats.in_flight == 0 and engine.stats.queue_depth == 0)
        assert engine.stats.cancelled == 1
    finally:
        engine.close()


async def test_a_job_that_cannot_start_fails_alone(engine: Engine) -> None:
    real_insert = engine._rows.generator.insert

    def broken_insert(*args: object, **kwargs: object) -> object:
        engine._rows.generator.insert = real_insert
        raise ValueError("simulated bad input")

    engine._rows.generator.insert = broken_insert
    job = engine.submit(GenerationRequest(prompt_of(engine, "x"), 3, GREEDY))
    events = [e async for e in job.events()]
    assert len(events) == 1 and "simulated bad input" in events[0].message  # type: ignore[union-attr]
    _, _, done = await run(engine, GenerationRequest(prompt_of(engine, "y"), 3, GREEDY))
    assert done.completion_tokens == 3
    assert engine.stats.queue_depth == 0 and engine.stats.in_flight == 0


async def test_cancel_after_finish_commits_at_once(think_engine: Engine) -> None:
    prompt = prompt_of(think_engine, "cancel me late", enable_thinking=False)
    commits = think_engine.stats.commits
    job = think_engine.submit(GenerationRequest(prompt, 50, GREEDY))
    await wait_until(lambda: "finished" in think_engine.stats.events_for(job.id))
    think_engine.cancel(job)  # the consumer never read the events: a client that left
    await wait_until(lambda: think_engine.stats.commits == commits + 1)
    _, _, done = await run(think_engine, GenerationRequest([*prompt, 7, 8], 5, GREEDY))
    assert done.cached_tokens >= len(prompt)


@settings(max_examples=300, deadline=None)
@given(
    a=st.lists(st.integers(min_value=0, max_value=2), max_size=30),
    b=st.lists(st.integers(min_value=0, max_value=2), max_size=30),
)
def test_common_prefix_matches_the_obvious_loop(a: list[int], b: list[int]) -> None:
    expected = 0
    while expected < min(len(a), len(b)) and a[expected] == b[expected]:
        expected += 1
    assert common_prefix(a, b) == expected
    assert common_prefix(tuple(a), b) == expected


@pytest.mark.parametrize("batching", [True, False])
async def test_reused_cache_gives_the_same_tokens_as_a_cold_run(
    tiny_model_dir: Path, batching: bool
) -> None:
    """Reusing (and trimming) a stored cache must not change what the model says, and must not
    corrupt the stored entry for the next reader."""
    cold_engine = Engine(
        str(tiny_model_dir), config=EngineConfig(batching=batching, commit_wait_s=0.0)
    )
    engine = Engine(str(tiny_model_dir), config=EngineConfig(batching=batching))
    cold_engine.start(timeout=60)
    engine.start(timeout=60)
    try:
        base = prompt_of(engine, "A shared beginning that several requests reuse")
        variants = [[*base, 40, 41, 42], [*base, 40, 50], [*base, 40, 41, 42, 43]]
        cold = []
        for prompt in variants:  # never committed: nothing is ever reused
            _, text, done = await run(
                cold_engine, GenerationRequest(prompt, 12, GREEDY), commit=False
            )
            assert done.cached_tokens == 0
            cold.append(text)
        await run(engine, GenerationRequest([*base, 40, 41, 42, 43, 44], 12, GREEDY))
        warm = []
        for prompt in variants + variants:
            _, text, done = await run(engine, GenerationRequest(prompt, 12, GREEDY))
            assert done.cached_tokens > len(base)
            warm.append(text)
        assert warm == cold + cold
    finally:
        engine.close()
        cold_engine.close()


def test_sampling_defaults_come_from_generation_config(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    (model / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20})
    )
    registry = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
    engine = Engine(str(model), generation_config_fallback=registry)
    engine.start(timeout=60)
    try:
        defaults = engine.sampling_defaults
        assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.95, 20)
        assert defaults.source == "generation_config.json"
    finally:
        engine.close()


def test_sampling_defaults_fall_back_to_the_registry_then_mlx_lm(tiny_model_dir: Path) -> None:
    registry = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
    engine = Engine(str(tiny_model_dir), generation_config_fallback=registry)
    engine.start(timeout=60)
    try:
        defaults = engine.sampling_defaults
        assert (defaults.temperature, defaults.top_p, defaults.source) == (0.2, 0.9, "registry")
    finally:
        engine.close()
    plain = Engine(str(tiny_model_dir))
    plain.start(timeout=60)
    try:
        assert plain.sampling_defaults == MLX_LM_DEFAULTS  # greedy, like mlx_lm.generate
    finally:
        plain.close()
