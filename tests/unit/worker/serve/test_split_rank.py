"""Rank 0's side of a split, in one process: the per-step deadline (pure core), the caches a
leader refuses because its followers could not mirror them, and the real engine's cache
operations mirrored by an in-process follower (worker/split/cache.py)."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from worker.engine.core import Engine
from worker.engine.types import EngineConfig, Failed, Finished, GenerationRequest, TokenChunk
from worker.sampling import SamplingParams
from worker.serve.split_rank import leader_config
from worker.speculative.policy import Speculation
from worker.split.cache import (
    COPY,
    EXTEND,
    EXTRACT,
    FILTER,
    FINALIZE,
    MERGE,
    NEW,
    PREPARE,
    SplitCacheError,
    Step,
)
from worker.split.leader import LeaderModel, SplitRankError, StepWatch
from worker.split.lockstep import HEADER, INLINE, Lockstep, Op, more_to_receive, pack, unpack
from worker.split.replay import FollowerCaches
from worker.split.signals import WAKE_LINE
from worker.testing import make_tiny_gemma3_model, make_tiny_model, wait_until


def test_a_step_is_overdue_only_past_its_deadline() -> None:
    watch = StepWatch(base_s=3.0, per_token_s=0.5, on_overdue=lambda why: None, cold_steps=0)
    assert watch.overdue(100.0) is None  # idle: no deadline at all
    watch.begin(4, now=100.0)  # 3 s + 4 * 0.5 s
    assert watch.overdue(104.9) is None
    assert watch.overdue(105.0) == "a 4-token step missed its deadline"
    watch.end()
    assert watch.overdue(1000.0) is None


def test_the_first_steps_of_a_new_group_get_the_cold_deadline() -> None:
    watch = StepWatch(3.0, 0.0, lambda why: None, cold_steps=2, cold_s=60.0)
    for _ in range(2):  # reading weights on first use, compiling kernels
        watch.begin(1, now=0.0)
        assert watch.overdue(59.0) is None
        watch.end()
    watch.begin(1, now=0.0)
    assert watch.overdue(3.0) is not None


def test_a_broken_group_stays_broken() -> None:
    watch = StepWatch(base_s=3.0, per_token_s=0.0, on_overdue=lambda why: None, cold_steps=0)
    watch.begin(1, now=0.0)
    watch.broken("the split group broke (peer lost)", grace_s=1.0, now=1.0)
    watch.end()  # the failed step's cleanup does not cancel the exit
    watch.begin(1, now=1.5)  # nor does a later step
    assert watch.overdue(1.9) is None
    assert watch.overdue(2.0) == "the split group broke (peer lost)"


def test_start_calls_back_once_overdue() -> None:
    seen: list[str] = []
    watch = StepWatch(base_s=0.0, per_token_s=0.0, on_overdue=seen.append, cold_steps=0)
    watch.start(tick_s=0.01)
    watch.begin(1)
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == ["a 1-token step missed its deadline"]


@pytest.fixture(scope="module")
def leader(tmp_path_factory: pytest.TempPathFactory) -> LeaderModel:
    model, _ = load_model(make_tiny_model(tmp_path_factory.mktemp("m") / "m"))
    return LeaderModel(model, Lockstep(None))


def test_the_leader_runs_its_own_caches_and_refuses_foreign_ones(leader: LeaderModel) -> None:
    cache = make_prompt_cache(leader)
    mx.eval(leader(mx.array([[1, 2, 3]]), cache=cache))
    cache[0].trim(1)  # trims and copies are the followers' to mirror now
    mx.eval(leader(mx.array([[4]]), cache=cache))
    assert cache[0].offset == 3
    # A cache that already holds tokens but was never run by this leader.
    foreign = make_prompt_cache(leader)
    mx.eval(leader.inner(mx.array([[1, 2]]), cache=foreign))
    with pytest.raises(SplitRankError, match="never saw"):
        leader(mx.array([[3]]), cache=foreign)
    with pytest.raises(SplitRankError):
        leader(mx.array([[1], [2]]), cache=make_prompt_cache(leader))  # a batch


def test_rank_0_gets_the_budget_of_the_rank_with_the_most_layers() -> None:
    """Rank 0 weighs only its own layers' KV; a follower holds the same entries for its."""
    config = leader_config([2, 4, 1], 1200)
    assert config.prompt_cache_bytes == 600
    assert config.batching and config.share_prefill


class MirrorLockstep(Lockstep):
    """A group of one whose "follower" is in this process: it applies every announced step to
    caches of its own and runs the pass on them with the same (whole) model."""

    def __init__(self) -> None:
        super().__init__(None)
        self.model: Any = None
        self.followers = FollowerCaches(lambda: make_prompt_cache(self.model))
        self.last: list[Any] = []
        self.batches = 0  # batched passes
        self.widest = 0  # most rows in one

    def send(self, op: Op, step: Step | None = None, tokens: Sequence[int] = ()) -> None:
        assert step is not None or op not in (Op.FORWARD, Op.BATCH)
        if op is Op.FORWARD:
            assert step is not None
            self.last = self.followers.prepare(step)
            self.model(mx.array([list(tokens)]), cache=self.last)
            mx.eval([c.state for c in self.last])
        elif op is Op.BATCH:
            assert step is not None
            self.batches += 1
            self.widest = max(self.widest, step.source)
            self.last = self.followers.prepare_batch(step)
            self.model(mx.array(list(tokens)).reshape(step.source, -1), cache=self.last)
            mx.eval([c.state for c in self.last])


class CheckedLeader(LeaderModel):
    """After every pass: the follower's cache holds exactly rank 0's keys and values."""

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        out = super().__call__(inputs, cache=cache, **kwargs)
        lockstep = self._lockstep
        mirror = lockstep.last
        # Those rank 0 let go of were freed before the pass: no more caches than rank 0's.
        assert len(lockstep.followers) == len(self.ledger)
        for ours, theirs in zip(cache, mirror, strict=True):
            assert _same(ours.state, theirs.state)
        return out


def _same(a: Any, b: Any) -> bool:
    """Equal cache states: arrays element for element, the rest as values."""
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, mx.array):
        return isinstance(b, mx.array) and bool(mx.array_equal(a, b).item())
    return bool(a == b)


def mirrored_engine(model_dir: Path) -> tuple[Engine, MirrorLockstep]:
    """An engine with rank 0's settings whose model is a :class:`CheckedLeader`."""
    from mlx_lm.utils import load_tokenizer

    lockstep = MirrorLockstep()

    def load(path: str) -> tuple[Any, Any, dict[str, Any]]:
        model, config = load_model(Path(path))
        lockstep.model = model
        return CheckedLeader(model, lockstep), load_tokenizer(Path(path)), config

    engine = Engine(str(model_dir), config=leader_config([2], 1 << 30), loader=load)
    engine.start(timeout=60)
    return engine, lockstep


async def test_the_followers_caches_mirror_rank_0s_engine(tiny_model_dir: Path) -> None:
    """The real engine, as rank 0 runs it, with its prompt cache and shared prefills: every
    forward pass's cache on the follower side equals rank 0's; later turns reuse the earlier
    ones' KV; the follower keeps no more caches than rank 0 does."""
    engine, lockstep = mirrored_engine(tiny_model_dir)
    try:
        leader = engine._model
        greedy = SamplingParams(temperature=0.0)
        turn1 = list(range(5, 45))
        job, first = await _run(engine, GenerationRequest(turn1, 6, greedy))
        assert first.cached_tokens == 0
        held = job.held
        # The next turn extends the first conversation: its KV is reused (a copy of it).
        _, second = await _run(engine, GenerationRequest([*held, 7, 8, 9], 6, greedy))
        assert second.cached_tokens == len(held)
        # A prompt that leaves the first turn half way: a trimmed copy.
        _, third = await _run(engine, GenerationRequest([*turn1[:20], 99, 98], 4, greedy))
        assert third.cached_tokens == 20
        # Two at once with one long prompt: the second forks the first's prefill.
        shared = list(range(100, 160))
        both = [GenerationRequest([*shared, n], 5, greedy) for n in (1, 2)]
        results = await asyncio.gather(*(_run(engine, r) for r in both))
        assert engine.stats.shared_prefills >= 1
        assert lockstep.widest == 2  # they ran as one batch
        assert all(done.completion_tokens == 5 for _, done in results)
        assert len(leader.ledger) <= len(engine._store)
        # A client that leaves mid-answer: what its cache holds is kept, and a retry of the
        # same conversation reuses it.
        left = list(range(200, 230))
        job = engine.submit(GenerationRequest(left, 1000, greedy))
        async for event in job.events():
            if isinstance(event, TokenChunk) and event.completion_tokens >= 3:
                engine.cancel(job)
                break
        await wait_until(lambda: "cache_kept" in engine.stats.events_for(job.id))
        _, retry = await _run(engine, GenerationRequest([*left, 1], 3, greedy))
        assert retry.cached_tokens == len(left)
        # Rank 0 lets go of everything: so do the followers, at the next step.
        engine.discard_prompt_cache()
        await _run(engine, GenerationRequest([1, 2, 3], 2, greedy))
        assert len(lockstep.followers) == 1
    finally:
        engine.close()


async def test_followers_replay_speculative_verify_passes(tiny_model_dir: Path) -> None:
    """Rank 0 drafts and verifies (worker/speculative/batch.py); rows of one batch trim different
    rejected tails (trim, then right padding rolled into the left): after every pass the
    follower's caches equal rank 0's, and the answers equal an unsplit engine's without
    speculation."""
    engine, lockstep = mirrored_engine(tiny_model_dir)
    plain = Engine(str(tiny_model_dir), config=EngineConfig(speculation=Speculation(mode="off")))
    plain.start(timeout=60)
    try:
        greedy = SamplingParams(temperature=0.0)
        requests = [GenerationRequest(list(range(s, s + 30)), 40 + s, greedy) for s in (5, 9, 50)]
        split = await asyncio.gather(*(_run(engine, r) for r in requests))
        alone = await asyncio.gather(*(_run(plain, r) for r in requests))
        assert engine.speculation.accepted > 0
        assert lockstep.widest >= 2
        assert [job.held for job, _ in split] == [job.held for job, _ in alone]
    finally:
        engine.close()
        plain.close()


async def test_rotating_caches_mirror_too(tmp_path: Path) -> None:
    """gemma3's sliding layers (``RotatingKVCache``, window 4): past the window a cache can no
    longer be trimmed, on rank 0 as on the followers; a next turn that extends the whole first
    one still reuses it, and two prompts that share a long prefix still fork."""
    engine, lockstep = mirrored_engine(make_tiny_gemma3_model(tmp_path / "g", num_layers=3))
    try:
        greedy = SamplingParams(temperature=0.0)
        job, _ = await _run(engine, GenerationRequest(list(range(5, 30)), 5, greedy))
        _, second = await _run(engine, GenerationRequest([*job.held, 3, 4], 5, greedy))
        assert second.cached_tokens == len(job.held)
        shared = list(range(100, 140))
        both = [GenerationRequest([*shared, n], 4, greedy) for n in (1, 2)]
        for _, done in await asyncio.gather(*(_run(engine, r) for r in both)):
            assert done.completion_tokens == 4
        # The caches rank 0 extracted from a batch after its last pass reach the followers
        # with the next pass (CheckedLeader compares the counts at every pass).
        await _run(engine, GenerationRequest([1, 2], 1, greedy))
        assert lockstep.batches and lockstep.widest == 2  # the two forks ran as one batch
    finally:
        engine.close()


def test_every_batch_operation_of_mlx_lms_generator_is_mirrored(tiny_model_dir: Path) -> None:
    """mlx-lm's ``BatchGenerator`` driven directly, as the engine may: prompts of different
    lengths prefilled together in small chunks (right padding, then rolled into left padding),
    prefill batches split into generation, rows joining a running batch and leaving it, a
    cancelled row, a fork extracted from a running row, a finished row's cache reused. After
    every pass the follower's batch equals rank 0's (CheckedLeader), logs of every kind."""
    import importlib

    import mlx_lm.models.cache as mc

    generate = importlib.import_module("mlx_lm.generate")
    lockstep = MirrorLockstep()
    model, _ = load_model(tiny_model_dir)
    lockstep.model = model
    leader = CheckedLeader(model, lockstep)
    seen: list[int] = []
    replay = lockstep.followers._apply

    def apply(ops: tuple[int, ...], i: int) -> int:
        seen.append(ops[i])
        return replay(ops, i)

    lockstep.followers._apply = apply  # type: ignore[method-assign]
    gen = generate.BatchGenerator(
        leader, completion_batch_size=4, prefill_batch_size=2, prefill_step_size=5
    )
    prompts = [list(range(3, 3 + n)) for n in (7, 12, 3, 9, 16)]
    live = set(gen.insert([prompts[0]], max_tokens=[6]))
    finished: list[list[Any]] = []
    reused, forked = False, -10
    for step in range(80):
        if step == 2:
            live |= set(gen.insert(prompts[1:3], max_tokens=[9, 4]))
        if finished and not reused:
            reused = True
            reuse = [copy.copy(c) for c in finished[0]]  # as the engine's copy_cache does
            mc.trim_prompt_cache(reuse, 2)
            live |= set(gen.insert([prompts[3]], max_tokens=[5], caches=[reuse]))
            live |= set(gen.insert([prompts[4]], max_tokens=[7]))
            forked = step + 3
        if step == forked:
            running = [u for u in gen._generation_batch.uids if u in live]
            cache, _ = gen.extract_cache(running[:1])[running[0]]
            fork = [copy.copy(c) for c in cache]
            mc.trim_prompt_cache(fork, 1)
            live |= set(gen.insert([prompts[2]], max_tokens=[3], caches=[fork]))
        if step == forked + 2:
            victim = max(live)
            gen.remove([victim], return_prompt_caches=True)
            live.discard(victim)
        for response in gen.next()[1]:
            if response.finish_reason is not None:
                finished.append(response.prompt_cache)
                live.discard(response.uid)
        if not live:
            break
    assert not live
    kinds = {MERGE, COPY, FILTER, EXTEND, EXTRACT, PREPARE, FINALIZE}
    assert kinds <= set(seen), sorted(set(seen))
    assert lockstep.widest >= 3


def test_a_follower_out_of_step_with_rank_0s_batch_says_so(leader: LeaderModel) -> None:
    followers = FollowerCaches(lambda: make_prompt_cache(leader.inner))
    two_new = (MERGE, 7, 2, NEW, 0, NEW, 0)
    assert len(followers.prepare_batch(Step(7, 2, 0, (), two_new))) == len(leader.layers)
    with pytest.raises(SplitCacheError, match="is 2x0 here, 2x5 on rank 0"):
        followers.prepare_batch(Step(7, 2, 5))
    with pytest.raises(SplitCacheError, match="no batch 8"):
        followers.prepare_batch(Step(8, 1, 0))
    with pytest.raises(SplitCacheError, match="unknown batch operation 99"):
        followers.prepare_batch(Step(7, 2, 0, (), (99, 7)))


async def _run(engine: Engine, request: GenerationRequest) -> tuple[Any, Finished]:
    """A job to its end, committed as the HTTP layer does; ``job.held``: the tokens its cache
    holds (the prompt and what it generated)."""
    job = engine.submit(request)
    async for event in job.events():
        if isinstance(event, Finished):
            job.held = engine._commits.pending[job.id].tokens
            engine.commit(job)
            await wait_until(lambda: job.id not in engine._commits.pending)
            return job, event
        assert not isinstance(event, Failed), event
    raise AssertionError("no terminal event")


class RecordingLockstep(Lockstep):
    """A "group" that only records what rank 0 sends."""

    def __init__(self) -> None:
        super().__init__(None)
        self.group = object()  # type: ignore[assignment]
        self.sent: list[Op] = []

    def send(self, op: Op, step: Step | None = None, tokens: Sequence[int] = ()) -> None:
        self.sent.append(op)


def test_idle_followers_doze_once_and_the_next_pass_wakes_them(
    leader: LeaderModel, capsys: pytest.CaptureFixture[str]
) -> None:
    lockstep = RecordingLockstep()
    dozy = LeaderModel(leader.inner, lockstep, doze_after_s=1.0)
    start = time.monotonic()
    dozy.engine_idle(now=start + 0.5)
    assert lockstep.sent == []  # not idle long enough
    dozy.engine_idle(now=start + 1.5)
    dozy.engine_idle(now=start + 2.5)
    assert lockstep.sent == [Op.DOZE] and dozy.dozing  # once, however long it idles
    assert WAKE_LINE not in capsys.readouterr().out
    mx.eval(dozy(mx.array([[1, 2]]), cache=make_prompt_cache(dozy)))
    assert capsys.readouterr().out.splitlines() == [WAKE_LINE]  # before the pass's command
    assert lockstep.sent == [Op.DOZE, Op.FORWARD] and not dozy.dozing
    never = LeaderModel(leader.inner, RecordingLockstep())  # doze_after_s=0: never dozes
    never.engine_idle(now=time.monotonic() + 3600)
    assert not never.dozing


@given(
    op=st.sampled_from([Op.FORWARD, Op.BATCH, Op.DOZE, Op.STOP]),
    cache=st.integers(0, 1 << 20),
    source=st.integers(-1, 1 << 20),
    offset=st.integers(0, 1 << 20),
    drops=st.lists(st.integers(1, 1 << 20), max_size=12),
    ops=st.lists(st.integers(-2, 1 << 20), max_size=20),
    tokens=st.lists(st.integers(0, 1 << 17), max_size=40),
)
def test_a_command_packs_into_one_collective_when_short_and_unpacks_the_same(
    op: Op,
    cache: int,
    source: int,
    offset: int,
    drops: list[int],
    ops: list[int],
    tokens: list[int],
) -> None:
    step = Step(cache, source, offset, tuple(drops), tuple(ops))
    first, rest = pack(op, step, tokens)
    assert len(first) == HEADER + INLINE  # every rank receives a first message of one size
    short = len(drops) + len(ops) + len(tokens) <= INLINE
    assert (rest == []) == short  # a decode step: one round trip
    assert more_to_receive(first) == len(rest)
    assert unpack(first, rest) == (op, step, tokens)
