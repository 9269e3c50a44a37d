"""The followers' caches stay in step with rank 0's (worker/split/cache.py): whatever rank 0
copies, trims, runs and drops, the cache a follower runs each step on holds the same tokens, and
it holds no cache rank 0 let go of."""

from __future__ import annotations

import copy
import gc
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import trim_prompt_cache

from worker.split.cache import KEEP, NEW, CacheLedger, SplitCacheError
from worker.split.replay import FollowerCaches


class Layer:
    """A layer's KV cache that holds token ids instead of keys (what ``trim`` and a deep copy
    do to it is what they do to mlx-lm's)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    @property
    def offset(self) -> int:
        return len(self.tokens)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, len(self.tokens))
        del self.tokens[len(self.tokens) - n :]
        return n


def fresh() -> list[Layer]:
    return [Layer(), Layer()]


def run(ledger: CacheLedger, follower: FollowerCaches, cache: list[Layer], tokens: list[int]):
    """One forward pass on rank 0 and the follower; the follower's cache it ran on."""
    step = ledger.plan(cache)
    ledger.ran(step, len(tokens))
    mirror = follower.prepare(step)
    for layer in (*cache, *mirror):
        layer.tokens.extend(tokens)
    return step, mirror


def test_a_second_turn_runs_on_a_copy_and_the_stored_entry_stays() -> None:
    ledger, follower = CacheLedger(), FollowerCaches(fresh)
    first = fresh()
    step, _ = run(ledger, follower, first, [1, 2, 3, 4])
    assert (step.source, step.offset) == (NEW, 0)
    step, _ = run(ledger, follower, first, [5])  # its decode: in place
    assert (step.source, step.offset) == (KEEP, 4)
    # The prompt cache's fetch: a deep copy trimmed to the shared prefix.
    second = copy.deepcopy(first)
    trim_prompt_cache(second, 2)
    step, mirror = run(ledger, follower, second, [9, 9])
    assert step.source not in (NEW, KEEP) and step.offset == 3
    assert mirror[0].tokens == [1, 2, 3, 9, 9]
    # The stored entry was left alone: a third request still gets all of it.
    third = copy.deepcopy(first)
    _, mirror = run(ledger, follower, third, [6])
    assert mirror[1].tokens == [1, 2, 3, 4, 5, 6]


def test_a_cache_rank_0_drops_is_freed_by_the_next_step() -> None:
    ledger, follower = CacheLedger(), FollowerCaches(fresh)
    kept, gone = fresh(), fresh()
    run(ledger, follower, kept, [1])
    run(ledger, follower, gone, [2])
    assert len(follower) == 2
    del gone
    gc.collect()
    assert len(ledger) == 1  # counting does not lose the drop the next step carries
    step, _ = run(ledger, follower, kept, [3])
    assert len(step.drops) == 1
    assert len(follower) == 1


def test_what_the_followers_cannot_reproduce_is_refused() -> None:
    ledger, follower = CacheLedger(), FollowerCaches(fresh)
    foreign = fresh()
    foreign[0].tokens.append(1)  # filled without a step: the followers never saw it
    with pytest.raises(SplitCacheError, match="never saw"):
        ledger.plan(foreign)
    cache = fresh()
    run(ledger, follower, cache, [1, 2])
    cache[0].tokens.append(3)  # grown behind the ledger's back
    with pytest.raises(SplitCacheError, match="grew"):
        ledger.plan(cache)
    cache[0].trim(1)
    shallow = [copy.copy(layer) for layer in cache]  # shares the tag (and, for real, the arrays)
    with pytest.raises(SplitCacheError, match="shallow"):
        ledger.plan(shallow)
    with pytest.raises(SplitCacheError, match="out of step"):
        FollowerCaches(fresh).prepare(ledger.plan(cache))


def test_a_refused_step_keeps_the_drops_for_the_next() -> None:
    ledger, follower = CacheLedger(), FollowerCaches(fresh)
    kept, gone = fresh(), fresh()
    run(ledger, follower, kept, [1])
    run(ledger, follower, gone, [2])
    del gone
    gc.collect()
    foreign = fresh()
    foreign[0].tokens.append(1)
    with pytest.raises(SplitCacheError):
        ledger.plan(foreign)
    step, _ = run(ledger, follower, kept, [3])
    assert len(step.drops) == 1 and len(follower) == 1


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("new"), st.integers(0, 9)),
        st.tuples(st.just("copy"), st.integers(0, 9)),
        st.tuples(st.just("trim"), st.integers(0, 9), st.integers(1, 6)),
        st.tuples(st.just("run"), st.integers(0, 9), st.lists(st.integers(0, 99), min_size=1)),
        st.tuples(st.just("drop"), st.integers(0, 9)),
    ),
    max_size=60,
)


@pytest.fixture(scope="module")
def frozen_heap() -> Iterator[None]:
    """The test session's objects moved out of the collector's reach while this module runs:
    the history test calls ``gc.collect()`` thousands of times to free dropped caches, and a
    full collection over a loaded test process's heap took 0.1 s each (a 9-minute test)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_any_history_of_copies_trims_runs_and_drops_stays_in_step(
    frozen_heap: None, ops: list[tuple]
) -> None:
    ledger, follower = CacheLedger(), FollowerCaches(fresh)
    pool: list[list[Layer]] = []
    for op, i, *rest in ops:
        if op == "new" or not pool:
            pool.append(fresh())
            continue
        i %= len(pool)
        if op == "copy":
            pool.append(copy.deepcopy(pool[i]))
        elif op == "trim":
            trim_prompt_cache(pool[i], rest[0])
        elif op == "drop":
            del pool[i]
            gc.collect()
        else:
            expected = pool[i][0].tokens + rest[0]
            _, mirror = run(ledger, follower, pool[i], rest[0])
            assert [layer.tokens for layer in mirror] == [expected, expected]
            # Never more caches than rank 0 holds (those it dropped went with this step).
            assert len(follower) == len(ledger) <= len(pool)
