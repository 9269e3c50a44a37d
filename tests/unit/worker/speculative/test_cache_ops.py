"""A sliding-window layer after a verify pass and its trim: the same attention, step after step,
as a cache that was only ever given each row's accepted tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchRotatingKVCache

from worker.speculative.cache_ops import in_order, trim_window

WINDOW, DIM = 8, 4


def attend(cache: BatchRotatingKVCache, keys: mx.array) -> mx.array:
    """One attention layer's use of its cache: the mask first, then the update."""
    mask = cache.make_mask(keys.shape[2])
    k, v = cache.update_and_fetch(keys, keys)
    return mx.fast.scaled_dot_product_attention(keys, k, v, scale=1.0, mask=mask)


@pytest.mark.parametrize(
    ("lengths", "rounds"),
    [
        ([12], [[2]]),  # the window is full: the verify pass rotated it
        ([5], [[2], [0]]),  # not full yet, then full
        ([3], [[3], [3], [1]]),  # every draft rejected
        ([12, 12], [[0, 3]]),  # one row keeps all, the other none
        ([12, 5], [[1, 3], [2, 0]]),  # rows trim independently, left padding involved
        ([3, 20], [[3, 0], [0, 3], [1, 1]]),
    ],
)
def test_a_trimmed_window_attends_as_if_it_held_the_accepted_tokens_only(
    lengths: list[int], rounds: list[list[int]]
) -> None:
    width = 4  # the sampled token and three drafted ones
    rng = mx.random.key(len(lengths) + len(rounds))
    rows, longest = len(lengths), max(lengths)
    prompt = mx.random.normal((rows, 1, longest, DIM), key=rng)
    batch = BatchRotatingKVCache(WINDOW, [longest - n for n in lengths])
    attend(batch, prompt)
    kept = [prompt[i : i + 1, :, longest - n :] for i, n in enumerate(lengths)]
    for number, rejected in enumerate(rounds):
        verify = mx.random.normal((rows, 1, width, DIM), key=mx.random.key(number))
        in_order([batch])  # as the verify pass does
        attend(batch, verify)
        common = min(rejected)
        trim_window(batch, common, [r - common for r in rejected])
        kept = [
            mx.concatenate([k, verify[i : i + 1, :, : width - r]], axis=2)
            for i, (k, r) in enumerate(zip(kept, rejected, strict=True))
        ]
        # A few plain decode steps between verify passes, past a whole rotation at the end.
        steps = [mx.random.normal((rows, 1, 1, DIM), key=mx.random.key(100 + s)) for s in range(3)]
        if number == len(rounds) - 1:
            steps += [mx.random.normal((rows, 1, 1, DIM)) for _ in range(WINDOW + 2)]
        outputs = [attend(batch, step) for step in steps]
        for i in range(rows):
            alone = BatchRotatingKVCache(WINDOW, [0])
            attend(alone, kept[i])
            for step, output in zip(steps, outputs, strict=True):
                assert mx.allclose(attend(alone, step[i : i + 1]), output[i : i + 1], atol=1e-5)
        kept = [
            mx.concatenate([k, *(s[i : i + 1] for s in steps)], axis=2) for i, k in enumerate(kept)
        ]


@pytest.mark.parametrize(
    ("lengths", "decoded"),
    [([3], WINDOW), ([3, 20], WINDOW), ([12, 1], 2), ([20, 3, 5], 3), ([9, 2], 1)],
)
def test_a_verify_pass_on_a_rotated_window_sees_what_a_prefill_would(
    lengths: list[int], decoded: int
) -> None:
    """Decode steps rotate the window; the verify pass that follows (several tokens at once)
    must attend, at each of its positions, to each row's last window of tokens: rows shorter
    than the window included (their oldest token is the one a misplaced mask hides)."""
    rows, longest = len(lengths), max(lengths)
    prompt = mx.random.normal((rows, 1, longest, DIM), key=mx.random.key(7))
    batch = BatchRotatingKVCache(WINDOW, [longest - n for n in lengths])
    attend(batch, prompt)
    steps = [mx.random.normal((rows, 1, 1, DIM), key=mx.random.key(50 + s)) for s in range(decoded)]
    for step in steps:
        attend(batch, step)
    assert batch.rotated
    verify = mx.random.normal((rows, 1, 4, DIM), key=mx.random.key(99))
    in_order([batch])
    output = attend(batch, verify)
    for i, n in enumerate(lengths):
        alone = BatchRotatingKVCache(WINDOW, [0])
        history = [prompt[i : i + 1, :, longest - n :], *(s[i : i + 1] for s in steps)]
        attend(alone, mx.concatenate(history, axis=2))
        assert mx.allclose(attend(alone, verify[i : i + 1]), output[i : i + 1], atol=1e-5)
