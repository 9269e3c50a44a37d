"""A split rank: one process of a pipeline-split model, stepping in lockstep with the others.

Rank 0 leads: before each forward pass it broadcasts a command (``FORWARD`` these tokens on
this cache, or ``STOP``) to every rank with an ``all_sum``, then all ranks run that forward pass
(``worker.split.pipeline`` moves the activations between them). Only rank 0 computes logits and
samples; the sampled token is in its next ``FORWARD``. The other ranks follow (:func:`follow`)
and evaluate only their caches. Each rank keeps a KV cache per cache rank 0 holds (a running
request's, the prompt cache's entries): the command says which one a pass runs on and how
rank 0's engine copied, trimmed or dropped caches since (worker/split/cache.py), so the prompt
cache and shared prefills work as on an unsplit worker.

Rank 0 either serves the normal worker HTTP API (``--serve``: the real :class:`Engine`, whose
model is a ``worker.split.leader.LeaderModel`` that announces each forward pass) or, for tests and benchmarks,
runs :func:`generate` over ``--prompts`` (a JSON list of token-id lists; one ``{"tokens": …}``
line each). Split serving batches concurrent requests as the unsplit worker does.

Started as ``python -m worker.serve.split_rank --model DIR --split 3,3 [--serve --port N]`` with the
ring backend's ``MLX_RANK`` and ``MLX_HOSTFILE`` (a JSON file: per rank, a list of ``"ip:port"``
strings) in the environment, no ``mlx.launch``. Every rank prints one ``{"rank", "slice",
"layer_bytes", "active_bytes", "peak_rss_bytes"}`` line when it is done.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from worker.engine.types import SPECULATION_HELP, SPECULATION_MODES
from worker.split.cache import SplitCacheError
from worker.split.leader import LeaderModel, SplitRankError, StepWatch
from worker.split.lockstep import Lockstep, Op
from worker.split.pipeline import Slice, materialize, slice_model
from worker.split.replay import FollowerCaches
from worker.split.signals import GROUP_BROKEN

log = logging.getLogger(__name__)

Sampler = Callable[[mx.array], mx.array]


def forward(model: nn.Module, cache: list, tokens: Sequence[int]) -> mx.array:
    """Rank 0's forward pass over ``tokens`` (the last position's logits, evaluated)."""
    logits = model(mx.array([list(tokens)]), cache=cache)[:, -1, :]
    mx.eval(logits, [c.state for c in cache])
    return logits


def generate(
    leader: LeaderModel,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    eos: set[int],
    sampler: Sampler | None = None,
    prefill_step: int = 512,
    timings: dict[str, float] | None = None,
) -> list[int]:
    """Rank 0's side of one request, the simple loop (a fresh cache; each pass announced by
    ``leader``): prefill in chunks, decode greedily (or with ``sampler``) token by token.
    ``timings`` gets ``ttft_s`` (to the first token) and ``decode_s`` (the rest)."""
    started = time.perf_counter()
    from mlx_lm.models.cache import make_prompt_cache

    sample = sampler or (lambda logits: mx.argmax(logits, axis=-1))
    cache = make_prompt_cache(leader)
    logits = None
    for i in range(0, len(prompt), prefill_step):
        logits = forward(leader, cache, prompt[i : i + prefill_step])
    if logits is None:
        raise SplitRankError("an empty prompt")
    out: list[int] = []
    while True:
        token = int(sample(logits).item())
        out.append(token)
        if timings is not None:
            now = time.perf_counter()
            if len(out) == 1:
                timings["ttft_s"] = now - started
            timings["decode_s"] = now - started - timings["ttft_s"]
        if token in eos or len(out) >= max_tokens:
            return out
        logits = forward(leader, cache, [token])


def follow(model: nn.Module, lockstep: Lockstep) -> None:
    """A rank other than 0: run the forward passes rank 0 announces until it says ``STOP``,
    each on the cache its step names (copied, trimmed, freed as rank 0's were:
    worker/split/cache.py). Only the caches are evaluated (the send to the next rank hangs off
    the last one)."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = FollowerCaches(lambda: make_prompt_cache(model))
    while True:
        op, step, tokens = lockstep.receive()
        if op is Op.STOP:
            return
        if op is Op.DOZE:
            if not sys.stdin.buffer.read(1):  # the node that started this rank is gone
                raise RuntimeError("stdin closed while dozing")
            continue
        if op is Op.BATCH:
            cache = caches.prepare_batch(step)
            inputs = mx.array(tokens).reshape(step.source, -1)
        else:
            cache = caches.prepare(step)
            inputs = mx.array([tokens])
        if step.drops:
            mx.clear_cache()  # hand the freed caches' buffers back, as rank 0's engine does
        model(inputs, cache=cache)
        mx.eval([c.state for c in cache])


def load_slice(
    path: str | Path, group: mx.distributed.Group | None, split: Sequence[int] | None
) -> tuple[nn.Module, dict[str, Any], Slice | None, int]:
    """Load the model lazily, keep this rank's slice and read its layers' weights: (model,
    config, slice, bytes of those layers). Without a group it is the whole, unsplit model."""
    from mlx_lm.utils import load_model

    model, config = load_model(Path(path), lazy=True, strict=False)
    if mx.default_device() == mx.cpu:
        # As the engine does on the CPU (x86 emulates half precision): every rank must agree on
        # the activations' dtype, since recv_like takes it from the local input.
        model.set_dtype(mx.float32)
    part = None
    if group is not None and group.size() > 1:
        if split is None:
            raise SplitRankError("a split group needs --split")
        part = slice_model(model, group, split)
    return model, config, part, materialize(model, part)


def make_leader_loader(
    group: mx.distributed.Group,
    split: Sequence[int],
    lockstep: Lockstep,
    watch: StepWatch | None = None,
    *,
    doze_after_s: float = 0.0,
    made: list[LeaderModel] | None = None,
) -> Callable[[str], tuple[Any, Any, dict[str, Any]]]:
    """The engine's loader on rank 0: its slice, wrapped in a :class:`LeaderModel` (appended
    to ``made``, for the caller's shutdown)."""

    def load(path: str) -> tuple[Any, Any, dict[str, Any]]:
        from mlx_lm.utils import load_tokenizer

        model, config, _, _ = load_slice(path, group, split)
        tokenizer = load_tokenizer(Path(path), eos_token_ids=config.get("eos_token_id"))
        leader = LeaderModel(model, lockstep, watch, doze_after_s=doze_after_s)
        if made is not None:
            made.append(leader)
        return leader, tokenizer, config

    return load


def serve_leader(
    args: argparse.Namespace, group: mx.distributed.Group, split: Sequence[int]
) -> None:
    """Rank 0 with ``--serve``: the real engine behind the normal worker HTTP app, with its
    prompt cache and shared prefills (the followers mirror every cache it keeps, copies, trims
    and drops: worker/split/cache.py), batching as the unsplit worker (:func:`leader_config`)."""
    from worker.engine.core import Engine
    from worker.serve.app import serve
    from worker.serve.net import SECRET_ENV

    lockstep = Lockstep(group)
    watch = StepWatch(args.step_deadline_s, args.step_deadline_per_token_s, _exit_broken)
    watch.start()
    config = leader_config(split, int(args.prompt_cache_gb * (1 << 30)), args.speculation)
    leaders: list[LeaderModel] = []
    loader = make_leader_loader(
        group, split, lockstep, watch, doze_after_s=args.doze_after_s, made=leaders
    )
    engine = Engine(args.model, name=args.name, config=config, loader=loader)
    engine.start()
    try:
        secret = os.environ.pop(SECRET_ENV, None) or None
        serve(engine, args.host, args.port, secret=secret, warm_up=args.warm_up)
    finally:
        engine.close()
        # Dozing followers are not in the ring (their supervisor ends them): no STOP to send.
        if not any(leader.dozing for leader in leaders):
            lockstep.send(Op.STOP)


def leader_config(split: Sequence[int], prompt_cache_bytes: int, speculation: str = "auto") -> Any:
    """Rank 0's engine settings.

    The prompt cache's budget is each rank's: rank 0 measures only its own layers' KV, and a
    follower holds the same entries for its layers, so rank 0's store gets the budget scaled by
    its share of the largest slice (a follower with twice rank 0's layers then holds about the
    budget, rank 0 half of it).

    Speculation as on an unsplit worker: rank 0 drafts, and a verify pass is one more batch
    pass whose rejected tails are trimmed with the batch cache's own (recorded) operations.

    Batching as on an unsplit worker: what mlx-lm's ``BatchGenerator`` does to its batches'
    caches is recorded on rank 0 and replayed by the followers (worker/split/cache.py).

    No prefill of an answer's next turn (worker/engine/next_turns.py): it runs the model outside
    the generator, which the followers do not replay."""
    from worker.engine.types import EngineConfig
    from worker.speculative.policy import Speculation

    scaled = prompt_cache_bytes * split[0] // max(split)
    # No memory budget: measuring the KV per token would run a forward pass over the ring.
    return EngineConfig(
        prompt_cache_bytes=scaled,
        speculation=Speculation(mode=speculation),
        memory_budget_bytes=0,
        next_turn_max_tail=0,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker.serve.split_rank")
    parser.add_argument("--model", required=True, help="an MLX model directory")
    parser.add_argument("--split", help="layers per rank, by rank: 3,3 (rank 0 runs the last)")
    parser.add_argument("--prompts", help="rank 0: a JSON file, a list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prefill-step", type=int, default=512)
    parser.add_argument(
        "--speculation", choices=SPECULATION_MODES, default="auto", help=SPECULATION_HELP
    )
    parser.add_argument("--single", action="store_true", help="unsplit, no group (reference)")
    parser.add_argument("--serve", action="store_true", help="rank 0: the worker HTTP API")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--name", default=None, help="model name to serve as")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false")
    parser.add_argument(
        "--doze-after-s",
        type=float,
        default=0.0,
        help="rank 0: idle seconds before the followers doze off the ring; only for a group "
        "whose supervisor wakes them on rank 0's WAKE_LINE, as mesh up's does [0: never]",
    )
    parser.add_argument(
        "--prompt-cache-gb",
        type=float,
        default=2.0,
        help="rank 0: each rank's prompt-cache budget (0: no reuse), as the worker's",
    )
    parser.add_argument(
        "--step-deadline-s", type=float, default=3.0, help="rank 0: most seconds a step may take"
    )
    parser.add_argument(
        "--step-deadline-per-token-s",
        type=float,
        default=0.05,
        help="rank 0: more seconds per token of a step (prefill chunks)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from worker.cpu.allocator import return_freed_memory
    from worker.cpu.fast_path import reexec_with_fast_blas

    reexec_with_fast_blas()  # as the worker does (Linux CPU): same pid, arguments, environment
    return_freed_memory()  # as the worker does: freed memory goes back to the system
    logging.basicConfig(level=logging.WARNING)
    group = None if args.single else mx.distributed.init(backend="ring", strict=True)
    split = [int(n) for n in args.split.split(",")] if args.split else None
    rank = group.rank() if group is not None else 0
    if rank == 0 and args.serve:
        if group is None or split is None:
            raise SplitRankError("--serve needs a split group (MLX_RANK, MLX_HOSTFILE, --split)")
        serve_leader(args, group, split)
        _report(rank, None, 0)
        return 0
    model, _, part, layer_bytes = load_slice(args.model, group, split)
    lockstep = Lockstep(group)
    if rank == 0:
        leader = LeaderModel(model, lockstep)
        eos = eos_ids(Path(args.model))
        prompts = json.loads(Path(args.prompts).read_text()) if args.prompts else []
        for prompt in prompts:
            timings: dict[str, float] = {}
            tokens = generate(
                leader,
                prompt,
                max_tokens=args.max_tokens,
                eos=eos,
                prefill_step=args.prefill_step,
                timings=timings,
            )
            print(json.dumps({"tokens": tokens, **timings}), flush=True)
        lockstep.send(Op.STOP)
    else:
        try:
            follow(model, lockstep)
        except RuntimeError as exc:  # the ring backend's only error: a peer is gone
            print(f"split rank {rank}: the group broke ({exc})", file=sys.stderr, flush=True)
            return GROUP_BROKEN
        except SplitCacheError as exc:  # a bug: leave, so the group is re-formed from scratch
            print(f"split rank {rank}: {exc}", file=sys.stderr, flush=True)
            return GROUP_BROKEN
    _report(rank, part, layer_bytes)
    return 0


def _exit_broken(why: str) -> None:
    """The group cannot go on: say why and end the process at once (the engine thread may be
    stuck in a collective that never returns, so no orderly shutdown is possible)."""
    print(f"split rank 0: {why}; exiting so the group is re-formed", file=sys.stderr, flush=True)
    os._exit(GROUP_BROKEN)


def _report(rank: int, part: Slice | None, layer_bytes: int) -> None:
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, kB on Linux
    line = {
        "rank": rank,
        "slice": None if part is None else [part.start, part.end],
        "layer_bytes": layer_bytes,
        "active_bytes": mx.get_active_memory(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale,
    }
    print(json.dumps(line), flush=True)


def eos_ids(path: Path) -> set[int]:
    """The model's end-of-sequence token ids, from its config."""
    config = json.loads((path / "config.json").read_text())
    eos = config.get("eos_token_id")
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}


if __name__ == "__main__":
    sys.exit(main())
