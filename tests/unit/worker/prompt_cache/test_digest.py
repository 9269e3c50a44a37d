"""The prompt-cache digest: a cached prefix is always found, and the digest stays bounded."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.prompt_cache.digest import CacheDigest, block_hashes

BLOCK = 4
tokens = st.lists(st.integers(0, 50), min_size=0, max_size=80)


@given(entries=st.lists(tokens, min_size=1, max_size=8), pick=st.data())
def test_a_cached_prefix_is_always_found(entries, pick):
    digest = CacheDigest.of_entries(entries, block_size=BLOCK)
    entry = pick.draw(st.sampled_from(entries))
    extra = pick.draw(tokens)
    prompt = entry + extra  # a later turn: the cached entry, then more
    found = digest.cached_tokens(block_hashes(prompt, BLOCK))
    whole = (len(entry) // BLOCK) * BLOCK
    assert found >= whole  # the cached prefix, to its last whole block
    assert found % BLOCK == 0


@given(entries=st.lists(tokens, min_size=1, max_size=8), prompt=tokens)
def test_never_claims_more_than_some_entry_shares(entries, prompt):
    digest = CacheDigest.of_entries(entries, block_size=BLOCK)
    found = digest.cached_tokens(block_hashes(prompt, BLOCK))
    shared = max(_common(e, prompt) for e in entries)
    assert found <= shared


@settings(max_examples=50)
@given(entries=st.lists(st.lists(st.integers(0, 9), max_size=400), max_size=20), cap=st.integers(1, 64))  # fmt: skip
def test_size_stays_bounded_and_every_entry_keeps_its_deepest_block(entries, cap):
    digest = CacheDigest.of_entries(entries, block_size=BLOCK, max_hashes=cap)
    assert len(digest) <= cap
    chains = [block_hashes(e, BLOCK) for e in entries]
    chains = [c for c in chains if c]
    if len(chains) <= cap:  # each entry had a share of at least one hash: its deepest
        for entry, chain in zip([e for e in entries if len(e) >= BLOCK], chains, strict=True):
            assert digest.cached_tokens(chain) == len(chain) * BLOCK, entry


def test_a_long_prefix_is_found_coarsely_when_spread():
    entry = list(range(1000))
    digest = CacheDigest.of_entries([entry], block_size=10, max_hashes=10)
    assert len(digest) == 10
    assert digest.cached_tokens(block_hashes(entry, 10)) == 1000
    # A prompt sharing 555 tokens finds a kept block at or below them, not far below.
    prompt = entry[:555] + [-1 % 2**32] * 100
    assert 450 <= digest.cached_tokens(block_hashes(prompt, 10)) <= 550


def test_wire_round_trip_and_garbage():
    digest = CacheDigest.of_entries([list(range(300))], block_size=16)
    assert CacheDigest.from_wire(digest.to_wire()) == digest
    assert CacheDigest.from_wire(CacheDigest().to_wire()) == CacheDigest()
    for bad in ["", "x:AAAA", "16:!!", "16:AAA=", "0:"]:
        with pytest.raises(ValueError):
            CacheDigest.from_wire(bad)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_prompt_cache_store_keeps_its_digest_current():
    from mlx_lm.models.cache import KVCache

    from worker.prompt_cache.store import PromptCacheStore

    store = PromptCacheStore(max_entries=2, digest_block_size=BLOCK)
    first, second, third = list(range(40)), list(range(100, 140)), list(range(200, 240))
    store.insert(first, [KVCache()])
    assert store.digest.cached_tokens(block_hashes([*first, 7, 7, 7, 7], BLOCK)) == 40
    store.insert(second, [KVCache()])
    store.insert(third, [KVCache()])  # evicts the first (LRU, two entries at most)
    assert store.digest.cached_tokens(block_hashes(first, BLOCK)) == 0
    assert store.digest.cached_tokens(block_hashes(third, BLOCK)) == 40
    store.clear()
    assert len(store.digest) == 0


def test_common_blocks_finds_where_two_chains_part():
    from worker.prompt_cache.digest import common_blocks

    base = list(range(640))
    chain = block_hashes(base)
    assert common_blocks(chain, chain) == 10
    assert common_blocks(chain, block_hashes(base[:300] + [7] * 340)) == 4  # parts in block 5
    assert common_blocks(chain[:3], chain) == 3
    assert common_blocks([], chain) == 0
    assert common_blocks(chain, block_hashes([9, *base[1:]])) == 0
