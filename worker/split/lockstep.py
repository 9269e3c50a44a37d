"""The command channel of a split group: rank 0 announces each forward pass, the others receive.

A command is an :class:`Op` and a :class:`~worker.split.cache.Step` with its payload, packed
into ints (:func:`pack`, :func:`unpack`: pure) and carried by ``all_sum`` (:class:`Lockstep`).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import mlx.core as mx

from worker.split.cache import KEEP, Step


class Op(IntEnum):
    STOP = 0
    FORWARD = 2
    DOZE = 3  # nothing to do: block on stdin for a wake byte instead of in the ring
    BATCH = 4  # a forward pass on a batch: the step names it, its rows and columns


HEADER = 7  # op, cache id, source, offset, drops, batch ops, tokens
# Payload ints carried in the header's all_sum: a decode step's tokens (one per row of a full
# batch: the engine's completion_batch_size is 16) and a few drops; a step that also changes
# the batch (a row joining or leaving) may take a second. All the ints of one all_sum cost one
# round trip.
INLINE = 25


class Lockstep:
    """The command channel of a split group: rank 0 sends, every other rank receives.

    A forward pass is one ``all_sum`` of a fixed size: the header (the :class:`Step`: which
    follower cache, copied from which, trimmed to how many tokens, how many drops, batch
    operations and tokens follow) and up to :data:`INLINE` payload ints (the drops, the batch
    operations, then the tokens: a batch's rows one after another) – a decode step.
    A longer payload (a prefill chunk) takes a second ``all_sum``. Every collective is a round
    trip around the ring (over the network between nodes), so a decoded token pays one, not
    two. With no group (or a group of one) sending is a no-op: the same loop serves the
    unsplit reference."""

    def __init__(self, group: mx.distributed.Group | None) -> None:
        self.group = group if group is not None and group.size() > 1 else None

    def send(self, op: Op, step: Step | None = None, tokens: Sequence[int] = ()) -> None:
        if self.group is None:
            return
        first, rest = pack(op, step or Step(0, KEEP, 0), tokens)
        self._sum(mx.array(first, dtype=mx.int32))
        if rest:
            self._sum(mx.array(rest, dtype=mx.int32))

    def receive(self) -> tuple[Op, Step, list[int]]:
        assert self.group is not None, "only ranks of a split group receive"
        first = self._ints(mx.zeros((HEADER + INLINE,), dtype=mx.int32))
        rest = more_to_receive(first)
        return unpack(first, self._ints(mx.zeros((rest,), dtype=mx.int32)) if rest else [])

    def _ints(self, x: mx.array) -> list[int]:
        return [int(v) for v in self._sum(x).tolist()]  # type: ignore[union-attr, arg-type]

    def _sum(self, x: mx.array) -> mx.array:
        out = mx.distributed.all_sum(x, group=self.group, stream=mx.cpu)
        mx.eval(out)
        return out


def pack(op: Op, step: Step, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
    """A command as the ints of its first ``all_sum`` (header and, when short, the payload)
    and of its second (the payload, when it did not fit inline; else empty)."""
    drops, ops = list(step.drops), list(step.ops)
    header = [int(op), step.cache, step.source, step.offset, len(drops), len(ops), len(tokens)]
    payload = [*drops, *ops, *tokens]
    if len(payload) <= INLINE:
        return header + payload + [0] * (INLINE - len(payload)), []
    return header + [0] * INLINE, payload


def more_to_receive(first: Sequence[int]) -> int:
    """How many payload ints a second ``all_sum`` carries after ``first`` (0: none)."""
    count = first[4] + first[5] + first[6]
    return count if count > INLINE else 0


def unpack(first: Sequence[int], rest: Sequence[int]) -> tuple[Op, Step, list[int]]:
    op, cache, source, offset, drops, ops, count = first[:HEADER]
    payload = list(rest) if rest else list(first[HEADER : HEADER + drops + ops + count])
    step = Step(cache, source, offset, tuple(payload[:drops]), tuple(payload[drops : drops + ops]))
    return Op(op), step, payload[drops + ops :]
