"""One model split across the ranks of an MLX distributed group (pipeline parallelism).

Each rank runs a contiguous slice of the decoder's layers. The order is mlx-lm's
(``PipelineMixin.pipeline``): the *last* rank runs the first layers, rank 0 the last ones, so
activations flow ``size-1 → … → 1 → 0`` with ``mx.distributed.send``/``recv_like`` and rank 0,
which serves the model and samples, ends up with the final hidden state and the logits.

Any decoder (llama, gemma3, phi3, qwen2 …) is wrapped the way exo does it, without touching its
code:

- the first layer of the slice receives its input from the rank before (its own embedding
  output is only used for its shape, so it is never computed);
- the last layer of the slice sends its output to the rank after;
- every layer outside the slice becomes a :class:`SkippedLayer`: it passes the hidden state
  through and advances its KV cache by the right number of *zero-width* keys. The model's own
  loop, masks and cache bookkeeping (gemma3 builds its masks from ``cache[0]`` and a global
  layer's cache, llama reads ``layer.use_sliding``) therefore see exactly what they would see
  unsplit, and those caches cost no memory.

mlx-lm's own ``pipeline()`` (qwen2, deepseek …) is not used: it ``all_gather``s the final
hidden state to every rank, because ``mlx_lm.server`` runs the whole generation loop on every
rank. Here only rank 0 samples, so that gather would be one wasted collective per step, and a
hang: rank 0 evaluates only the caches during a prefill chunk (not the logits), so it would
skip a gather its followers wait in.

Only the weights a rank uses are ever read: load the model lazily, :func:`slice_model` it, then
:func:`materialize` the slice. A skipped layer's lazy arrays are never evaluated (MLX reads a
safetensors tensor only when it is), nor are the embeddings on ranks that receive their input or
the head on ranks other than 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn


class PipelineError(Exception):
    """The model cannot be split this way (no layer list, a split that does not add up)."""


@dataclass(frozen=True)
class Slice:
    """Rank ``rank`` of ``size`` runs layers ``[start, end)``."""

    rank: int
    size: int
    start: int
    end: int

    @classmethod
    def of(cls, split: Sequence[int], rank: int) -> Slice:
        """The slice of ``rank`` in ``split`` (layers per rank, indexed by rank: mlx-lm's
        ``pipeline(split=...)``): rank r runs the layers after those of ranks r+1 … size-1."""
        start = sum(split[rank + 1 :])
        return cls(rank, len(split), start, start + split[rank])


def decoder_of(model: nn.Module) -> nn.Module:
    """The module that holds the decoder's ``layers`` list (``model.model`` for llama and
    gemma3 text, ``model.language_model.model`` for multimodal wrappers): the shallowest one."""
    for _, module in sorted(model.named_modules(), key=lambda item: item[0].count(".")):
        layers = module.get("layers") if isinstance(module, dict) else None
        if isinstance(layers, list) and layers and module is not model:
            return module
    raise PipelineError(f"{type(model).__name__} has no decoder layer list to split")


def slice_model(model: nn.Module, group: mx.distributed.Group, split: Sequence[int]) -> Slice:
    """Make ``model`` run only this rank's layers of ``split`` over ``group`` (in place).

    ``split`` has one entry per rank (layers per rank, by rank; see :class:`Slice.of`)."""
    decoder = decoder_of(model)
    layers = decoder["layers"]
    if len(split) != group.size() or any(n <= 0 for n in split) or sum(split) != len(layers):
        raise PipelineError(
            f"split {list(split)} does not give {group.size()} ranks all {len(layers)} layers"
        )
    rank = group.rank()
    if group.size() == 1:
        return Slice(0, 1, 0, len(layers))
    part = Slice.of(split, rank)
    for i in range(len(layers)):
        if not part.start <= i < part.end:
            layers[i] = SkippedLayer(layers[i])
    if rank < part.size - 1:
        layers[part.start] = FirstLayer(layers[part.start], group, source=rank + 1)
    if rank > 0:
        layers[part.end - 1] = LastLayer(layers[part.end - 1], group, target=rank - 1)
    return part


def materialize(model: nn.Module, part: Slice | None = None) -> int:
    """Evaluate (read from disk) the weights of this rank's layers (all of them without a
    slice); the bytes they take. The shared weights a rank uses (embeddings, norm, head) are
    read by its first forward pass, the ones it does not use never are."""
    from mlx.utils import tree_flatten

    if part is None:
        tree = model.parameters()
    else:
        layers = decoder_of(model)["layers"]
        tree = [layers[i].parameters() for i in range(part.start, part.end)]
    mx.eval(tree)
    leaves: list[tuple[str, mx.array]] = tree_flatten(tree)  # type: ignore[assignment]
    return sum(v.nbytes for _, v in leaves)


class Wrapper(nn.Module):
    """A module in disguise, kept as ``inner``: attribute reads it does not answer itself reach
    the original (a model's reads of its layers: ``use_sliding``, ``is_sliding``,
    ``self_attn``…; an engine's of its model: ``layers``, ``make_cache``…)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __getattr__(self, key: str) -> Any:
        try:
            return super().__getattr__(key)
        except AttributeError:
            if key == "inner":
                raise
            return getattr(self["inner"], key)


class FirstLayer(Wrapper):
    """The slice's first layer: its input comes from rank ``source`` (only the shape of the
    local input is used)."""

    def __init__(self, inner: nn.Module, group: mx.distributed.Group, *, source: int) -> None:
        super().__init__(inner)
        self._group = group
        self._source = source

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        x = mx.distributed.recv_like(x, self._source, group=self._group)
        return self.inner(x, *args, **kwargs)


class LastLayer(Wrapper):
    """The slice's last layer on ranks other than 0: its output goes to rank ``target``."""

    def __init__(self, inner: nn.Module, group: mx.distributed.Group, *, target: int) -> None:
        super().__init__(inner)
        self._group = group
        self._target = target

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        out = mx.distributed.send(self.inner(x, *args, **kwargs), self._target, group=self._group)
        cache = _cache_argument(args, kwargs)
        if cache is not None and getattr(cache, "keys", None) is not None:
            # A follower evaluates only its caches: this puts the send in that graph.
            cache.keys = mx.depends(cache.keys, out)
        return out


class SkippedLayer(nn.Module):
    """A layer another rank runs: the hidden state passes through; its cache advances by
    zero-width keys and values, so offsets and masks match the unsplit model at no cost.

    The original layer is kept outside the module tree (its weights are neither listed nor
    evaluated), only so that the model can still read its flags."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_skipped", inner)

    def __getattr__(self, key: str) -> Any:
        try:
            return super().__getattr__(key)
        except AttributeError:
            if key == "_skipped":
                raise
            return getattr(object.__getattribute__(self, "_skipped"), key)

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        cache = _cache_argument(args, kwargs)
        if cache is not None:
            empty = mx.zeros((x.shape[0], 1, x.shape[1], 0), dtype=x.dtype)
            cache.update_and_fetch(empty, empty)
        return x


def _cache_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The KV cache among a layer's arguments (mlx-lm passes it positionally or as
    ``cache=``): the one object that has ``update_and_fetch``."""
    if "cache" in kwargs:
        return kwargs["cache"]
    return next((a for a in args if hasattr(a, "update_and_fetch")), None)
