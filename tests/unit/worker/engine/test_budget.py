"""One memory budget per worker: a job starts when its projected KV fits, waits otherwise (the
prompt cache's memory tier spilled first), is refused with a 429 only when the queue is full and
with a 413 when it could never fit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from worker.chat.prompt import ChatTemplate
from worker.engine.budget import BudgetRefusal, MemoryBudget, default_limit
from worker.engine.core import Engine
from worker.engine.types import EngineConfig, Finished, GenerationRequest, TokenChunk
from worker.prompt_cache.disk import DiskTierConfig
from worker.sampling import SamplingParams
from worker.testing import wait_until

GREEDY = SamplingParams(temperature=0.0)


def test_a_job_fits_while_the_running_and_cached_bytes_leave_room() -> None:
    budget = MemoryBudget(limit=1000, kv_bytes_per_token=2, draft_tokens=4)
    assert budget.need(100, 46) == 300
    budget.cache_bytes = 300
    budget.reserve("a", 300)
    assert budget.fits(400) and not budget.fits(401)
    budget.release("a")
    budget.release("a")  # twice is harmless
    assert budget.room() == 700


def test_on_submit_a_job_larger_than_the_budget_is_413_and_a_full_queue_429() -> None:
    budget = MemoryBudget(limit=1000, kv_bytes_per_token=1, max_waiting=2)
    with pytest.raises(BudgetRefusal) as never:
        budget.check_submit(1001, queued=0)
    assert never.value.status == 413
    budget.reserve("running", 800)
    budget.check_submit(300, queued=1)  # it waits its turn
    with pytest.raises(BudgetRefusal) as busy:
        budget.check_submit(300, queued=2)
    assert busy.value.status == 429 and busy.value.retry_after_s
    budget.check_submit(200, queued=2)  # fits now: no reason to refuse


def test_the_default_is_most_of_the_memory_less_the_weights() -> None:
    assert default_limit(10 << 30, 2 << 30) == (8 << 30) - (2 << 30)
    assert default_limit(None, 1) is None


# ---- the engine ------------------------------------------------------------------------------


def start(model_dir: Path, **config: object) -> Engine:
    engine = Engine(str(model_dir), config=EngineConfig(loop_guard_tokens=0, **config))  # type: ignore[arg-type]
    engine.start(timeout=60)
    return engine


def per_token(model_dir: Path) -> int:
    engine = start(model_dir)
    try:
        assert engine.memory_budget is not None
        # The weights are outside the budget but reported beside it (the lab's RSS bound).
        assert engine.memory_budget["weight_bytes"] > 0
        return engine.memory_budget["kv_bytes_per_token"]
    finally:
        engine.close()


def prompt(engine: Engine, text: str) -> list[int]:
    tokens, _ = ChatTemplate(engine.tokenizer).render([{"role": "user", "content": text}], None, {})
    return tokens


async def finish(engine: Engine, job: object) -> Finished:
    async for event in job.events():  # type: ignore[attr-defined]
        if not isinstance(event, TokenChunk):
            assert isinstance(event, Finished), event
            engine.commit(job)  # type: ignore[arg-type]
            return event
    raise AssertionError("no terminal event")


async def test_a_job_that_does_not_fit_waits_for_the_running_one_then_runs(
    tiny_model_dir: Path,
) -> None:
    kv = per_token(tiny_model_dir)
    probe = start(tiny_model_dir, memory_budget_bytes=0)
    first, second = prompt(probe, "one " * 20), prompt(probe, "two " * 20)
    probe.close()
    one_job = (len(first) + 40 + 8) * kv
    engine = start(tiny_model_dir, memory_budget_bytes=int(one_job * 1.5))
    try:
        jobs = [engine.submit(GenerationRequest(p, 40, GREEDY)) for p in (first, second)]
        done = await asyncio.gather(*(finish(engine, job) for job in jobs))
        assert all(d.completion_tokens > 0 for d in done)
        assert "waits_for_memory" in engine.stats.events_for(jobs[1].id)
        await wait_until(lambda: engine.memory_budget["running_kv_bytes"] == 0)  # type: ignore[index]
    finally:
        engine.close()


async def test_the_memory_tier_spills_to_disk_before_a_job_waits(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    kv = per_token(tiny_model_dir)
    disk = DiskTierConfig(str(tmp_path), 1 << 30, "tiny", min_tokens=16, hot_interval_s=3600)
    probe = start(tiny_model_dir, memory_budget_bytes=0)
    first, second = prompt(probe, "alpha " * 40), prompt(probe, "omega " * 40)
    probe.close()
    one_job = (len(first) + 8 + 8) * kv
    engine = start(tiny_model_dir, memory_budget_bytes=int(one_job * 1.6), prompt_cache_disk=disk)
    try:
        await finish(engine, engine.submit(GenerationRequest(first, 8, GREEDY)))
        await wait_until(lambda: engine.stats.commits == 1)
        assert engine.memory_budget["prompt_cache_bytes"] > 0  # type: ignore[index]
        done = await finish(engine, engine.submit(GenerationRequest(second, 8, GREEDY)))
        assert done.completion_tokens > 0
        disk = engine.prompt_cache_disk
        assert disk is not None
        await wait_until(lambda: engine.prompt_cache_disk["writes"] == 1)  # type: ignore[index]
        assert engine.prompt_cache["evictions"] == 1  # the memory tier's spill, counted
        # The first conversation's prefix is on disk, and comes back from there.
        again = await finish(engine, engine.submit(GenerationRequest([*first, 7], 4, GREEDY)))
        assert again.cached_tokens >= len(first) - 1
    finally:
        engine.close()


async def test_a_full_queue_is_refused_with_a_429_and_a_too_large_job_with_a_413(
    tiny_model_dir: Path,
) -> None:
    kv = per_token(tiny_model_dir)
    probe = start(tiny_model_dir, memory_budget_bytes=0)
    text = prompt(probe, "x " * 20)
    probe.close()
    one_job = (len(text) + 400 + 8) * kv
    engine = start(tiny_model_dir, memory_budget_bytes=int(one_job * 1.5))
    try:
        with pytest.raises(BudgetRefusal) as never:
            engine.submit(GenerationRequest(text, 10 * 400, GREEDY))
        assert never.value.status == 413
        running = engine.submit(GenerationRequest(text, 400, GREEDY))
        await wait_until(lambda: engine.stats.in_flight == 1)
        assert engine._gate is not None
        engine._gate.budget.max_waiting = 1
        waiting = engine.submit(GenerationRequest(text, 400, GREEDY))
        with pytest.raises(BudgetRefusal) as busy:
            engine.submit(GenerationRequest(text, 400, GREEDY))
        assert busy.value.status == 429
        for job in (running, waiting):
            engine.cancel(job)
        await wait_until(lambda: engine.stats.queue_depth == 0 and engine.stats.in_flight == 0)
        assert engine.memory_budget["running_kv_bytes"] == 0  # type: ignore[index]
    finally:
        engine.close()


def test_a_cache_landing_over_the_limit_is_spilled_at_the_next_look() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from worker.engine.memory_gate import MemoryGate
    from worker.prompt_cache.store import PromptCacheStore

    def kv(tokens: int) -> list[KVCache]:
        layer = KVCache()
        layer.update_and_fetch(mx.zeros((1, 2, tokens, 8)), mx.zeros((1, 2, tokens, 8)))
        return [layer]

    store = PromptCacheStore()
    for start in range(3):  # three conversations' caches, landed as their jobs ended
        store.insert([start, *range(100, 400)], kv(301))
    budget = MemoryBudget(limit=store.nbytes // 2, kv_bytes_per_token=64)
    gate = MemoryGate(budget, store, pending_bytes=lambda: 0)
    gate.refresh()
    assert budget.used <= budget.limit  # spilled (least recently used first), not only counted
    assert 0 < len(store) < 3
