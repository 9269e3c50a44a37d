"""A compact, bounded digest of what a prompt cache holds, for routing by prefix. Pure.

A token sequence is cut into blocks of ``block_size`` tokens; block ``i``'s hash chains the
hash of block ``i-1`` with block ``i``'s tokens, so one hash stands for the whole prefix up to
the end of that block. The digest of a cache is the set of chained hashes of every cached
entry's blocks. A prompt's cached length is then ``(i + 1) * block_size`` for the deepest
block ``i`` of the prompt whose hash is in the set: no need for the shallower blocks, which is
what lets the digest stay bounded – past ``max_hashes`` an entry keeps its deepest hash and
an even spread of the others, so a prefix is still found, at a coarser granularity.

Hashes are 64-bit (blake2b): with ``max_hashes`` of them, a false match needs a 2^-64-ish
accident per block looked up; a false match only costs a worse route, never a wrong answer.
On the wire the digest is one base64 string of packed little-endian u64s (8 bytes a hash).
"""

from __future__ import annotations

import base64
import hashlib
import struct
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_BLOCK_SIZE = 64
DEFAULT_MAX_HASHES = 2048  # 16 KiB packed: the digest's bound, whatever the cache holds
_SEED = b"mlx-mesh-prefix-v1"


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the shared prefix: binary search on slice equality (compared in C)."""
    a, b = list(a), list(b)
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def block_hashes(tokens: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE) -> list[int]:
    """The chained hash of every whole block of ``tokens`` (a partial last block has none)."""
    whole = len(tokens) // block_size
    if whole == 0:
        return []
    packed = array("I", tokens[: whole * block_size]).tobytes()
    step = block_size * 4
    out: list[int] = []
    previous = _SEED
    for i in range(whole):
        previous = hashlib.blake2b(previous + packed[i * step : (i + 1) * step], digest_size=8).digest()  # fmt: skip
        out.append(int.from_bytes(previous, "little"))
    return out


def common_blocks(chain: Sequence[int], hashes: Sequence[int]) -> int:
    """How many leading blocks two chains share. Chained hashes agree up to a depth and differ
    from there on, so a binary search finds the deepest equal one."""
    lo, hi = 0, min(len(chain), len(hashes))
    while lo < hi:  # invariant: the first lo blocks agree; none past hi does
        mid = (lo + hi + 1) // 2
        if chain[mid - 1] == hashes[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _spread(hashes: list[int], keep: int) -> list[int]:
    """``keep`` of ``hashes``, evenly spaced and always including the deepest."""
    if keep >= len(hashes):
        return hashes
    if keep <= 0:
        return []
    n = len(hashes)
    picked = {n - 1 - (i * n) // keep for i in range(keep)}
    return [hashes[i] for i in sorted(picked)]


@dataclass(frozen=True, slots=True)
class CacheDigest:
    """The chained block hashes a cache holds, for blocks of ``block_size`` tokens."""

    block_size: int = DEFAULT_BLOCK_SIZE
    hashes: frozenset[int] = frozenset()

    @classmethod
    def of_entries(
        cls,
        entries: Iterable[Sequence[int]],
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_hashes: int = DEFAULT_MAX_HASHES,
    ) -> CacheDigest:
        """The digest of cached token sequences given most valuable first (most recently used):
        each gets an equal share of what is left of ``max_hashes``, the first ones first."""
        chains = [block_hashes(tokens, block_size) for tokens in entries]
        return cls.of_chains(chains, block_size=block_size, max_hashes=max_hashes)

    @classmethod
    def of_chains(
        cls, chains: Sequence[list[int]], *, block_size: int, max_hashes: int = DEFAULT_MAX_HASHES
    ) -> CacheDigest:
        """As :meth:`of_entries`, from each entry's :func:`block_hashes` (computed once)."""
        chains = [c for c in chains if c]
        kept: set[int] = set()
        for index, chain in enumerate(chains):
            share = (max_hashes - len(kept)) // (len(chains) - index)
            kept.update(_spread(chain, share))
        return cls(block_size, frozenset(kept))

    def __len__(self) -> int:
        return len(self.hashes)

    def cached_tokens(self, prompt_hashes: Sequence[int]) -> int:
        """Tokens of a prompt (given as its :func:`block_hashes`) this cache holds a prefix of."""
        for depth in range(len(prompt_hashes), 0, -1):
            if prompt_hashes[depth - 1] in self.hashes:
                return depth * self.block_size
        return 0

    # ---- wire form ---------------------------------------------------------------------------

    def to_wire(self) -> str:
        """``"<block_size>:<base64 of packed u64s>"`` (sorted, so equal digests compare equal)."""
        packed = struct.pack(f"<{len(self.hashes)}Q", *sorted(self.hashes))
        return f"{self.block_size}:{base64.b64encode(packed).decode()}"

    @classmethod
    def from_wire(cls, text: str, *, max_hashes: int = 4 * DEFAULT_MAX_HASHES) -> CacheDigest:
        """Parse :meth:`to_wire`; raises ValueError for anything else or an oversized digest."""
        size_text, _, body = text.partition(":")
        block_size = int(size_text)
        raw = base64.b64decode(body, validate=True)
        if block_size <= 0 or len(raw) % 8 or len(raw) // 8 > max_hashes:
            raise ValueError("not a cache digest")
        return cls(block_size, frozenset(struct.unpack(f"<{len(raw) // 8}Q", raw)))
