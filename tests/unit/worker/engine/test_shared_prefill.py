"""The rule that picks which running job a new prompt takes its prefill from (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from worker.engine.shared_prefill import Share, SharePolicy, Source, plan_share, shared_tokens
from worker.prompt_cache.digest import common_prefix

PROMPT = list(range(100, 200))  # 100 tokens


def test_an_identical_prompt_shares_all_but_its_last_token() -> None:
    assert shared_tokens(PROMPT, PROMPT) == 99
    share = plan_share(PROMPT, [Source(1, PROMPT, held=0)], cached=0)
    assert share == Share(1, 99, ready=False)


def test_a_source_that_holds_the_shared_tokens_is_ready() -> None:
    assert plan_share(PROMPT, [Source(1, PROMPT, held=99)], cached=0) == Share(1, 99, True)
    # Decoding already: its cache holds the whole prompt and more; only the prompt counts.
    assert plan_share(PROMPT, [Source(1, PROMPT, held=100)], cached=0) == Share(1, 99, True)


def test_a_prompt_that_extends_the_source_takes_the_source_prompt() -> None:
    longer = [*PROMPT, 1, 2, 3]
    assert plan_share(longer, [Source(1, PROMPT, held=100)], cached=0) == Share(1, 100, True)


def test_nothing_to_gain_over_the_prompt_cache_is_no_share() -> None:
    assert plan_share(PROMPT, [Source(1, PROMPT, held=99)], cached=99) is None
    assert plan_share(PROMPT, [Source(1, [7, 8, 9], held=3)], cached=0) is None
    assert plan_share(PROMPT, [], cached=0) is None


def test_a_small_shared_prefix_is_not_worth_waiting_for() -> None:
    # 10 tokens of a template in common: the job does its own prefill rather than wait for a chunk.
    other = [*PROMPT[:10], *range(900, 990)]
    assert plan_share(PROMPT, [Source(1, other, held=0)], cached=0) is None
    # ... but once the other one holds them, copying is free of waiting.
    assert plan_share(PROMPT, [Source(1, other, held=50)], cached=0) == Share(1, 10, True)


def test_a_prefix_under_half_of_the_own_work_is_not_worth_waiting_for() -> None:
    other = [*PROMPT[:40], *range(900, 990)]  # 40 of 99 shared: less than half
    assert plan_share(PROMPT, [Source(1, other, held=0)], cached=0) is None
    other = [*PROMPT[:60], *range(900, 990)]
    assert plan_share(PROMPT, [Source(1, other, held=0)], cached=0) == Share(1, 60, False)
    loose = SharePolicy(min_tokens=1, min_share=0.0)
    assert plan_share(PROMPT, [Source(1, PROMPT[:40], held=0)], cached=0, policy=loose) == Share(
        1, 40, False
    )


def test_the_source_sharing_most_wins_then_the_one_furthest_along() -> None:
    sources = [
        Source(1, [*PROMPT[:70], 5], held=70),
        Source(2, PROMPT, held=0),
        Source(3, PROMPT, held=64),
    ]
    assert plan_share(PROMPT, sources, cached=0) == Share(3, 99, False)


@given(
    st.lists(st.integers(0, 3), max_size=30),
    st.lists(st.lists(st.integers(0, 3), max_size=30), max_size=4),
    st.lists(st.integers(0, 40), min_size=4, max_size=4),
    st.integers(0, 30),
)
def test_a_plan_never_asks_for_more_than_the_source_can_give(
    prompt: list[int], others: list[list[int]], helds: list[int], cached: int
) -> None:
    cached = min(cached, max(0, len(prompt) - 1))
    sources = [Source(i, p, h) for i, (p, h) in enumerate(zip(others, helds, strict=False))]
    share = plan_share(prompt, sources, cached=cached)
    if share is None:
        return
    source = sources[share.key]
    assert cached < share.tokens <= len(prompt) - 1  # a gain, and one token left to run
    assert share.tokens <= common_prefix(source.prompt, prompt)
    assert share.ready == (source.held >= share.tokens)
