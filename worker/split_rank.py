"""A split rank: one process of a pipeline-split model, stepping in lockstep with the others.

Rank 0 drives: for each forward pass it broadcasts a command (``RESET`` a request's cache,
``FORWARD`` these tokens, ``STOP``) to every rank with an ``all_sum``, then all ranks run the
same forward pass (``worker.pipeline`` moves the activations between them) and evaluate the
same logits. Rank 0 samples and puts the token into its next ``FORWARD``. The other ranks only
follow (:func:`follow`). This is the simple loop: one request at a time, no prompt cache.

Started as ``python -m worker.split_rank --model DIR --split 3,3`` with the ring backend's
``MLX_RANK`` and ``MLX_HOSTFILE`` (a JSON list, per rank, of ``"ip:port"`` strings) in the
environment. ``--prompts FILE`` (a JSON list of token-id lists) makes rank 0 generate for each
and print one JSON line per prompt (``{"tokens": [...]}``); every rank prints one
``{"rank", "slice", "weights_bytes", "peak_rss_bytes"}`` line when it is done.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from collections.abc import Callable, Sequence
from enum import IntEnum
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from worker.pipeline import Slice, materialize, slice_model

Sampler = Callable[[mx.array], mx.array]


class Op(IntEnum):
    STOP = 0
    RESET = 1
    FORWARD = 2


class Lockstep:
    """The command channel of a split group: rank 0 sends, every other rank receives.

    With no group (or a group of one) it is a plain, local loop: the same code serves the
    unsplit reference."""

    def __init__(self, group: mx.distributed.Group | None) -> None:
        self.group = group if group is not None and group.size() > 1 else None

    def send(self, op: Op, tokens: Sequence[int] = ()) -> None:
        if self.group is None:
            return
        self._sum(mx.array([int(op), len(tokens)], dtype=mx.int32))
        if tokens:
            self._sum(mx.array(list(tokens), dtype=mx.int32))

    def receive(self) -> tuple[Op, list[int]]:
        assert self.group is not None, "only ranks of a split group receive"
        op, count = self._sum(mx.zeros((2,), dtype=mx.int32)).tolist()
        tokens = self._sum(mx.zeros((count,), dtype=mx.int32)).tolist() if count else []
        return Op(op), tokens

    def _sum(self, x: mx.array) -> mx.array:
        out = mx.distributed.all_sum(x, group=self.group, stream=mx.cpu)
        mx.eval(out)
        return out


def forward(model: nn.Module, cache: list, tokens: Sequence[int]) -> mx.array:
    """One forward pass over ``tokens``: the last position's logits, evaluated together with
    every cache (each rank must run the gather inside; skipped layers' caches stay small)."""
    logits = model(mx.array([list(tokens)]), cache=cache)[:, -1, :]
    mx.eval(logits, [c.state for c in cache])
    return logits


def generate(
    model: nn.Module,
    lockstep: Lockstep,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    eos: set[int],
    sampler: Sampler | None = None,
    prefill_step: int = 512,
) -> list[int]:
    """Rank 0's side of one request: prefill in chunks, then decode token by token."""
    from mlx_lm.models.cache import make_prompt_cache

    sample = sampler or (lambda logits: mx.argmax(logits, axis=-1))
    lockstep.send(Op.RESET)
    cache = make_prompt_cache(model)
    logits = None
    for i in range(0, len(prompt), prefill_step):
        chunk = prompt[i : i + prefill_step]
        lockstep.send(Op.FORWARD, chunk)
        logits = forward(model, cache, chunk)
    assert logits is not None, "an empty prompt"
    out: list[int] = []
    while True:
        token = int(sample(logits).item())
        out.append(token)
        if token in eos or len(out) >= max_tokens:
            return out
        lockstep.send(Op.FORWARD, [token])
        logits = forward(model, cache, [token])


def follow(model: nn.Module, lockstep: Lockstep) -> None:
    """A non-zero rank: run the forward passes rank 0 asks for until it says ``STOP``."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    while True:
        op, tokens = lockstep.receive()
        if op is Op.STOP:
            return
        if op is Op.RESET:
            cache = make_prompt_cache(model)
        else:
            forward(model, cache, tokens)


def load_slice(
    path: str | Path, group: mx.distributed.Group | None, split: Sequence[int] | None
) -> tuple[nn.Module, Slice | None, int]:
    """Load the model lazily, keep this rank's slice, read only its weights: (model, slice,
    bytes of the weights evaluated). Without a group it is the whole, unsplit model."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path), lazy=True, strict=False)
    part = None
    if group is not None and group.size() > 1:
        if split is None:
            raise ValueError("a split group needs --split")
        part = slice_model(model, group, split)
    return model, part, materialize(model)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.split_rank")
    parser.add_argument("--model", required=True)
    parser.add_argument("--split", help="layers per rank, by rank: 3,3")
    parser.add_argument("--prompts", help="rank 0: a JSON file, a list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prefill-step", type=int, default=512)
    parser.add_argument("--single", action="store_true", help="unsplit, no group (reference)")
    args = parser.parse_args(argv)

    group = None if args.single else mx.distributed.init(backend="ring", strict=True)
    split = [int(n) for n in args.split.split(",")] if args.split else None
    model, part, weights = load_slice(args.model, group, split)
    lockstep = Lockstep(group)
    rank = group.rank() if group is not None else 0
    if rank == 0:
        eos = eos_ids(Path(args.model))
        prompts = json.loads(Path(args.prompts).read_text()) if args.prompts else []
        for prompt in prompts:
            tokens = generate(
                model,
                lockstep,
                prompt,
                max_tokens=args.max_tokens,
                eos=eos,
                prefill_step=args.prefill_step,
            )
            print(json.dumps({"tokens": tokens}), flush=True)
        lockstep.send(Op.STOP)
    else:
        follow(model, lockstep)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (
        1 if sys.platform == "darwin" else 1024
    )
    where = None if part is None else [part.start, part.end]
    print(
        json.dumps({"rank": rank, "slice": where, "weights_bytes": weights, "peak_rss_bytes": rss}),
        flush=True,
    )
    return 0


def eos_ids(path: Path) -> set[int]:
    config = json.loads((path / "config.json").read_text())
    eos = config.get("eos_token_id")
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}


if __name__ == "__main__":
    sys.exit(main())
