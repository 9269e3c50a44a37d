"""Rejected verify positions kept as masked holes give each row what the roll gives it: the same
attention output, rotary offset and extracted cache, through ragged passes, rows leaving and
rows joining (worker/speculative/holes.py against worker/speculative/cache_ops.py:trim_rows)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import BatchKVCache, KVCache

from worker.speculative.cache_ops import trim_rows
from worker.speculative.holes import Holes

H, D = 2, 4


def _rows(rng: np.random.Generator, lengths: list[int]) -> list[KVCache]:
    rows = []
    for n in lengths:
        row = KVCache()
        row.update_and_fetch(*(mx.array(rng.normal(size=(1, H, n, D)), mx.float32),) * 2)
        rows.append(row)
    return rows


class Pair:
    """The same batch twice: rolled (the reference) and with holes."""

    def __init__(self, rows: list[KVCache]) -> None:
        self.rolled = BatchKVCache.merge(rows)
        self.holed = BatchKVCache.merge(rows)
        self.holes = Holes()

    def feed(self, keys: mx.array) -> None:
        for cache in (self.rolled, self.holed):
            cache.update_and_fetch(keys, keys * 2)

    def verify(self, keys: mx.array, rejected: list[int]) -> None:
        self.feed(keys)
        trim_rows([self.rolled], rejected)
        trim_rows([self.holed], rejected, self.holes)

    def filter(self, keep: list[int]) -> None:
        self.holes.filter([self.holed], keep)
        self.rolled.filter(keep)
        self.holed.filter(keep)

    def extend(self, rows: list[KVCache]) -> None:
        before = self.holed._idx
        self.rolled.extend(BatchKVCache.merge(rows))
        joining = BatchKVCache.merge(rows)
        self.holed.extend(joining)
        self.holes.extend([self.holed], before, None, joining._idx)

    def attend(self, queries: mx.array) -> tuple[mx.array, mx.array]:
        """Both batches' attention for ``queries`` (fed as the next tokens)."""
        n = queries.shape[2]
        outs = []
        for cache in (self.rolled, self.holed):
            mask = cache.make_mask(n)
            keys, values = cache.update_and_fetch(queries, queries * 2)
            outs.append(
                mx.fast.scaled_dot_product_attention(
                    queries, keys, values, scale=D**-0.5, mask=mask
                )
            )
            cache.trim(n)
        return outs[0], outs[1]

    def check(self, rng: np.random.Generator) -> None:
        assert self.rolled.offset.tolist() == self.holed.offset.tolist()
        rows = self.rolled.offset.shape[0]
        for n in (1, 3):
            queries = mx.array(rng.normal(size=(rows, H, n, D)), mx.float32)
            rolled, holed = self.attend(queries)
            assert np.allclose(np.array(rolled), np.array(holed), atol=1e-5)
        for row in range(rows):
            want = self.rolled.extract(row)
            got = (self.holes.extract([self.holed], row) or [self.holed.extract(row)])[0]
            assert got.offset == want.offset
            assert np.array_equal(np.array(got.keys), np.array(want.keys))
            assert np.array_equal(np.array(got.values), np.array(want.values))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), ops=st.lists(st.sampled_from("vvvfe"), min_size=1, max_size=8))
def test_holes_answer_as_the_roll_does(seed: int, ops: list[str]) -> None:
    rng = np.random.default_rng(seed)
    pair = Pair(_rows(rng, list(rng.integers(1, 12, size=3))))
    for op in ops:
        rows = pair.rolled.offset.shape[0]
        if op == "v":  # a verify pass: each row keeps 1..width of it
            width = int(rng.integers(2, 6))
            kept = rng.integers(1, width + 1, size=rows)
            pair.verify(mx.array(rng.normal(size=(rows, H, width, D)), mx.float32),
                        [width - int(k) for k in kept])  # fmt: skip
        elif op == "f" and rows > 1:  # a row finishes
            pair.filter(sorted(rng.choice(rows, size=rows - 1, replace=False).tolist()))
        elif op == "e":  # rows join
            pair.extend(_rows(rng, list(rng.integers(1, 30, size=int(rng.integers(1, 3))))))
        pair.check(rng)


def test_a_pass_that_rejects_alike_leaves_no_holes() -> None:
    rng = np.random.default_rng(0)
    pair = Pair(_rows(rng, [4, 6]))
    pair.verify(mx.array(rng.normal(size=(2, H, 4, D)), mx.float32), [2, 0])
    assert pair.holes.valid is not None and "make_mask" in pair.holed.__dict__
    pair.filter([1])  # the row with holes leaves
    assert pair.holes.valid is None and "make_mask" not in pair.holed.__dict__
    pair.verify(mx.array(rng.normal(size=(1, H, 3, D)), mx.float32), [1])
    assert pair.holes.valid is None
    pair.check(rng)
