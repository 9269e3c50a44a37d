"""Rank 0's side of a split, in one process: the per-step deadline (pure core) and the caches a
leader refuses because its followers could not mirror them."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from worker.split_rank import LeaderModel, Lockstep, SplitRankError, StepWatch
from worker.testing import make_tiny_model


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


def test_the_leader_runs_fresh_caches_and_refuses_foreign_ones(leader: LeaderModel) -> None:
    cache = make_prompt_cache(leader)
    mx.eval(leader(mx.array([[1, 2, 3]]), cache=cache))
    mx.eval(leader(mx.array([[4]]), cache=cache))
    assert cache[0].offset == 4
    # A cache that already holds tokens but was never run by this leader (a prompt-cache hit).
    foreign = make_prompt_cache(leader)
    mx.eval(leader.inner(mx.array([[1, 2]]), cache=foreign))
    with pytest.raises(SplitRankError, match="cannot reuse"):
        leader(mx.array([[3]]), cache=foreign)
    # The running cache trimmed behind the followers' back.
    cache[0].trim(1)
    with pytest.raises(SplitRankError, match="trimmed"):
        leader(mx.array([[5]]), cache=cache)
    with pytest.raises(SplitRankError):
        leader(mx.array([[1], [2]]), cache=make_prompt_cache(leader))  # a batch
