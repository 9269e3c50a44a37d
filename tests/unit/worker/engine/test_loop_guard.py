"""worker.engine.loop_guard: exact loops end an answer; anything else never does."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from worker.engine.loop_guard import LoopGuard


def _first_loop(tokens: list[int], span: int = 64) -> int | None:
    guard = LoopGuard(span=span)
    for i, token in enumerate(tokens):
        if guard.feed(token):
            return i
    return None


def test_a_repeated_sentence_stops_once_it_fills_the_span():
    sentence = list(range(100, 115))  # 15 tokens
    tokens = list(range(40)) + sentence * 10
    at = _first_loop(tokens, span=64)
    assert at == 40 + 64 - 1  # the 64th token of the looping part
    guard = LoopGuard(span=64)
    for token in tokens[: at + 1]:
        guard.feed(token)
    assert guard.period == 15


def test_one_token_repeated_is_a_loop_and_a_short_run_is_not():
    assert _first_loop([7] * 64) == 63
    assert _first_loop([7] * 63) is None


def test_a_block_as_long_as_a_quarter_span_must_repeat_four_times():
    block = list(range(16))
    assert _first_loop(block * 4, span=64) == 63
    assert _first_loop(list(range(17)) * 3, span=64) is None  # period 17 > 64 // 4


@given(st.lists(st.integers(0, 5), max_size=300))
def test_it_fires_exactly_when_the_last_span_tokens_are_periodic(tokens):
    span = 24
    guard = LoopGuard(span=span)
    for i, token in enumerate(tokens):
        window = tokens[max(0, i - span + 1) : i + 1]
        periodic = len(window) == span and any(
            all(window[j] == window[j - p] for j in range(p, span)) for p in range(1, span // 4 + 1)
        )
        assert guard.feed(token) == periodic
        if periodic:
            break
