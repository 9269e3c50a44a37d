"""Attention of CPU prefill chunks in numpy: MLX's CPU softmax runs its ``exp`` on one thread.

On the CPU backend ``mx.fast.scaled_dot_product_attention`` is MLX's composed fallback: a BLAS
matmul, a mask, a precise softmax, a second matmul. Its ``exp`` runs single-threaded at ~18 ns
an element (numpy's: ~0.4 ns), so with 3,072 keys a 512-token chunk spent 240-300 ms of its
~400 ms per layer in the softmax (``bench/results/cpu.md``). Here the same four steps run in
numpy, over tiles of ``ROW_BLOCK`` query rows of the query heads that share a KV head (one
BLAS call for the group: 8 % less CPU time than one call per head), on a small thread pool (the BLAS calls of each tile on one thread; numpy releases the GIL), and
over the keys a tile can see only: keys that every row of a tile masks out get weight 0 in MLX
too (``exp(finfo.min - max)`` is 0), so they are skipped (a causal chunk's upper triangle,
left padding, a sliding window's far past).

The result is MLX's up to float32 rounding (summation order, the ``exp`` implementation), so
greedy outputs stay the same. A decode step (one query a row) takes numpy when several rows
read a long context (``decode_in_numpy``): its keys split over the threads and the parts'
softmaxes merged, a short row's left padding skipped (bench/results/decode-attention.md).
Other decode steps, small calls (fewer than ``MIN_QUERY_TOKENS`` queries and ``MIN_SCORES``
scores a head: short verify passes over a short context), quantized KV caches and dtypes other
than float32 stay on MLX, as does everything on Metal: :func:`install` is called by the CPU
fast path only (``worker.cpu.fast_path.prepare_cpu_model``).
``MLX_MESH_CPU_ATTENTION=off`` leaves MLX's attention in place.

The numpy path evaluates the queries, keys and values when the model's graph is built (MLX is
lazy), so a chunk's graph is cut at every attention layer: harmless for prefill, which evaluates
every chunk anyway, but the reason the short-query cases stay lazy on MLX.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from typing import Any

import numpy as np

from worker.mlx_lm_hooks import mlx_attention, patch_attention, unpatch_attention

log = logging.getLogger(__name__)

ATTENTION_ENV = "MLX_MESH_CPU_ATTENTION"
OFF_VALUES = frozenset({"off", "0", "no", "false", "mlx"})
# Fewer queries stay on MLX unless the call is big enough (below): decode steps keep their
# lazy, pipelined graph (the numpy path evaluates at every layer). In isolation numpy wins
# from 4 queries at 3,072 keys (0.6 vs 8 ms for 9 heads); 32 is the first size only prefill
# reaches.
MIN_QUERY_TOKENS = 32
# A speculative verify pass (2-9 queries a row) evaluates right after its forward pass, so
# cutting its graph costs it nothing, and its softmax grows with rows x queries x keys.
# SmolLM2-135M on this 2-core box (bench/results/speculative.md): 4 rows x 9 queries over
# 1,500 keys 391 -> 247 ms a pass, 4 x 5 over 512 keys 163 -> 143 ms; 1 row x 5 over 512
# keys 86 vs 91 ms (MLX ahead). So calls of 2+ queries take numpy from this many score
# elements a head (batch x queries x keys).
MIN_SCORES = 4096
# A decode step (one query a row) cuts its lazy graph at every layer when it takes numpy
# (~0.3 ms a layer), which pays once MLX's one-thread ``exp`` over rows x keys scores costs more:
# with several rows over long contexts, and most with short rows left-padded beside a long one
# (numpy skips keys a row cannot see). Read off bench/results/decode-attention.md.
MIN_DECODE_ROWS = 2
MIN_DECODE_SCORES = 6144
# Query rows per tile and query head, so a tile's scores stay in cache: a whole 512-row chunk
# per tile took 1.5-2x the time (3,072 keys); 32, 64 and 128 rows measured within 10 %.
ROW_BLOCK = 64
MAX_THREADS = 8
# Keys a part of a decode step reads at least (fewer: the threads' handoff outweighs the work).
MIN_PART_KEYS = 256
_F32_MIN = np.finfo(np.float32).min


# ---- the numpy attention -----------------------------------------------------------------


def _blas_local_threads() -> Any:
    """numpy's bundled OpenBLAS's per-thread thread-count setter, or None (another BLAS)."""
    libs = os.path.join(os.path.dirname(np.__file__) + ".libs", "libscipy_openblas*.so*")
    for path in glob.glob(libs):
        try:
            setter = ctypes.CDLL(path).openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        setter.argtypes = [ctypes.c_int]
        setter.restype = ctypes.c_int
        return setter
    return None


class _Pool:
    """Worker threads for tiles, each with numpy's BLAS on one thread (tiles are small and the
    pool already uses every core). Without a way to pin the BLAS to one thread: one worker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._setter: Any = None
        self._started = False
        self.workers = 1

    def size(self) -> int:
        self._start()
        return self.workers

    def map(self, work: Any, parts: list[Any]) -> None:
        executor = self._start()
        if executor is None or len(parts) == 1:
            for part in parts:
                work(part)
            return
        for future in [executor.submit(self._run, work, part) for part in parts]:
            future.result()

    def _run(self, work: Any, part: Any) -> None:
        self._setter(1)
        work(part)

    def _start(self) -> ThreadPoolExecutor | None:
        with self._lock:
            if not self._started:
                self._started = True
                self._setter = _blas_local_threads()
                cores = min(os.cpu_count() or 1, MAX_THREADS)
                if self._setter is not None and cores > 1:
                    self.workers = cores
                    self._executor = ThreadPoolExecutor(cores, thread_name_prefix="cpu-attn")
            return self._executor


_pool = _Pool()


def _key_range(mask: np.ndarray | None) -> tuple[int, int] | None:
    """The keys a tile's boolean mask lets any row see, as [lo, hi), when every row sees at
    least one (a row that sees none is uniform over all keys in MLX, so nothing is skipped)."""
    if mask is None:
        return None
    if not mask.any(axis=-1).all():
        return None
    seen = np.asarray(mask.any(axis=tuple(range(mask.ndim - 1))))
    return int(seen.argmax()), int(seen.size - seen[::-1].argmax())


def _tile(
    q: np.ndarray,  # (R, rows, D): the R query heads of one KV head, already scaled
    k: np.ndarray,  # (S, D)
    v: np.ndarray,  # (S, Dv)
    mask: np.ndarray | None,  # (R, rows, S) bool or float (a view), or None
    causal_first: int | None,  # causal: absolute position of the tile's first query
    sinks: np.ndarray | None,  # (R,)
    out: np.ndarray,  # (R, rows, Dv) (a view)
) -> None:
    heads, rows, _ = q.shape
    lo, hi = 0, k.shape[0]
    if causal_first is not None:
        hi = causal_first + rows
    elif mask is not None and mask.dtype == np.bool_:
        lo, hi = _key_range(mask) or (lo, hi)
    scores = np.matmul(q.reshape(heads * rows, -1), k[lo:hi].T)
    grid = scores.reshape(heads, rows, hi - lo)
    if causal_first is not None:
        np.copyto(grid[:, :, causal_first - lo :], _F32_MIN, where=_upper(rows))
    elif mask is not None:
        _apply_mask(grid, mask[..., lo:hi])
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sink = np.repeat(sinks, rows)[:, None]
        np.maximum(top, sink, out=top)
    scores -= top
    np.exp(scores, out=scores)
    total = scores.sum(axis=-1, keepdims=True)
    if sinks is not None:
        total += np.exp(sink - top)
    scores /= total
    out[...] = (scores @ v[lo:hi]).reshape(heads, rows, -1)


def _decode(
    scaled: np.ndarray,  # (B, Hq, 1, D), already scaled
    keys: np.ndarray,  # (B, Hkv, S, D)
    values: np.ndarray,  # (B, Hkv, S, Dv)
    mask: np.ndarray | None,  # (B, Hq, 1, S) bool or float (a broadcast view), or None
    sinks: np.ndarray | None,  # (Hq,)
    out: np.ndarray,  # (B, Hq, 1, Dv)
) -> None:
    """One query a row: the keys a row can see split into parts over the threads (each reads
    its own share of the cache, the bound of a decode step), every KV head of the row in one
    part; the parts' softmaxes merged by their maxima and sums (as flash-decoding does)."""
    batch, heads, _, dim = scaled.shape
    kv_heads, total = keys.shape[1], keys.shape[2]
    grouped = (batch, kv_heads, heads // kv_heads)
    q = scaled.reshape(*grouped, dim)
    seen = None if mask is None else mask.reshape(*grouped, total)
    spans = [(0, total)] * batch
    if seen is not None and seen.dtype == np.bool_:
        spans = [_key_range(seen[b]) or (0, total) for b in range(batch)]
    workers = _pool.size()
    share = max(MIN_PART_KEYS, -(-sum(hi - lo for lo, hi in spans) // workers))
    parts = []
    for b, (lo, hi) in enumerate(spans):
        pieces = max(1, -(-(hi - lo) // share))
        edges = np.linspace(lo, hi, pieces + 1).astype(int)
        parts += [(b, int(a), int(z)) for a, z in pairwise(edges)]
    partials: dict[tuple[int, int, int], tuple[np.ndarray, ...]] = {}

    def work(chunk: Sequence[tuple[int, int, int]]) -> None:
        for b, lo, hi in chunk:
            scores = np.matmul(q[b], keys[b, :, lo:hi].transpose(0, 2, 1))  # (Hkv, R, n)
            if seen is not None:
                _apply_mask(scores, seen[b, ..., lo:hi])
            top = scores.max(axis=-1, keepdims=True)
            scores -= top
            np.exp(scores, out=scores)
            partials[b, lo, hi] = (
                top,
                scores.sum(axis=-1, keepdims=True),
                scores @ values[b, :, lo:hi],
            )

    _pool.map(work, [parts[i::workers] for i in range(min(workers, len(parts)))])
    sink = None if sinks is None else sinks.reshape(kv_heads, -1, 1)
    for b in range(batch):
        mine = [partials[p] for p in parts if p[0] == b]
        top = np.maximum.reduce([t for t, _, _ in mine])
        if sink is not None:
            top = np.maximum(top, sink)
        weights = [np.exp(t - top) for t, _, _ in mine]
        total_weight = sum(w * s for w, (_, s, _) in zip(weights, mine, strict=True))
        if sink is not None:
            total_weight = total_weight + np.exp(sink - top)
        merged = sum(w * o for w, (_, _, o) in zip(weights, mine, strict=True))
        out[b, :, 0] = (merged / total_weight).reshape(heads, -1)


def _apply_mask(scores: np.ndarray, mask: np.ndarray) -> None:
    """A boolean mask hides what it does not let through (``exp`` gives it 0); any other is
    added to the scores."""
    if mask.dtype == np.bool_:
        np.copyto(scores, _F32_MIN, where=~mask)
    else:
        scores += mask


_uppers: dict[int, np.ndarray] = {}


def _upper(n: int) -> np.ndarray:
    """Where a tile of ``n`` consecutive queries must not see the tile's own last ``n`` keys."""
    found = _uppers.get(n)
    if found is None:
        found = _uppers[n] = np.triu(np.ones((n, n), dtype=np.bool_), k=1)
    return found


def attention(
    queries: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    scale: float,
    mask: np.ndarray | str | None = None,
    sinks: np.ndarray | None = None,
    *,
    row_block: int = ROW_BLOCK,
) -> np.ndarray:
    """``mx.fast.scaled_dot_product_attention`` in float32 numpy: queries (B, Hq, L, D), keys
    (B, Hkv, S, D), values (B, Hkv, S, Dv) with Hq a multiple of Hkv; ``mask`` None, "causal"
    (the last query sees every key), or an array broadcastable to (B, Hq, L, S): boolean (True
    attends) or added to the scores; ``sinks`` (Hq,) one extra logit per head. (B, Hq, L, Dv)."""
    batch, heads, length, _ = queries.shape
    kv_heads, total = keys.shape[1], keys.shape[2]
    repeats = heads // kv_heads
    scaled = queries * np.float32(scale)  # MLX scales the queries first, in their dtype
    out = np.empty((batch, heads, length, values.shape[-1]), dtype=np.float32)
    full = None
    if isinstance(mask, np.ndarray):
        full = np.broadcast_to(mask, (batch, heads, length, total))
    if length == 1:
        _decode(scaled, keys, values, full, sinks, out)
        return out
    offset = total - length if isinstance(mask, str) else None
    tiles = [
        (b, h, start)
        for b in range(batch)
        for h in range(kv_heads)
        for start in range(0, length, row_block)
    ]

    def work(part: Sequence[tuple[int, int, int]]) -> None:
        for b, h, start in part:
            stop = min(start + row_block, length)
            group = slice(h * repeats, (h + 1) * repeats)
            _tile(
                scaled[b, group, start:stop],
                keys[b, h],
                values[b, h],
                None if full is None else full[b, group, start:stop],
                None if offset is None else offset + start,
                None if sinks is None else sinks[group],
                out[b, group, start:stop],
            )

    workers = max(1, min(_pool.size(), len(tiles)))
    # Interleaved: the causal triangle's cheap and dear tiles spread over the threads.
    _pool.map(work, [tiles[i::workers] for i in range(workers)])
    return out


# ---- the hook in mlx-lm's models ---------------------------------------------------------


def wanted(queries: Any, keys: Any, values: Any, cache: Any, mask: Any, sinks: Any) -> bool:
    """Whether the numpy path takes this call (else MLX's own runs)."""
    import mlx.core as mx

    if hasattr(cache, "bits"):  # a quantized KV cache: MLX's quantized attention
        return False
    if queries.ndim != 4 or keys.ndim != 4 or values.ndim != 4:
        return False
    if any(a.dtype != mx.float32 for a in (queries, keys, values)):
        return False
    batch, heads, length = queries.shape[:3]
    if length == 1:
        if not decode_in_numpy(batch, keys.shape[2]):
            return False
    elif length < MIN_QUERY_TOKENS and batch * length * keys.shape[2] < MIN_SCORES:
        return False
    if heads % keys.shape[1]:
        return False
    if sinks is not None and (sinks.dtype != mx.float32 or sinks.shape != (heads,)):
        return False
    if isinstance(mask, str):
        return mask == "causal" and queries.shape[2] <= keys.shape[2]
    if mask is None:
        return True
    return mask.ndim <= 4 and mask.dtype in (mx.bool_, mx.float32)


def decode_in_numpy(rows: int, keys: int) -> bool:
    """Whether a decode step of ``rows`` rows over ``keys`` cached positions takes numpy."""
    return rows >= MIN_DECODE_ROWS and rows * keys >= MIN_DECODE_SCORES


def scaled_dot_product_attention(
    queries: Any,
    keys: Any,
    values: Any,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: Any = None,
) -> Any:
    """mlx-lm's ``scaled_dot_product_attention``, in numpy for the calls :func:`wanted` takes."""
    import mlx.core as mx

    if not wanted(queries, keys, values, cache, mask, sinks):
        return mlx_attention()(queries, keys, values, cache, scale, mask, sinks)
    arrays = [queries, keys, values]
    arrays += [a for a in (mask, sinks) if isinstance(a, mx.array)]
    mx.eval(*arrays)
    # Views, not copies: numpy reads an evaluated CPU array's buffer (strides included).
    out = attention(
        np.asarray(queries),
        np.asarray(keys),
        np.asarray(values),
        scale,
        np.asarray(mask) if isinstance(mask, mx.array) else mask,
        None if sinks is None else np.asarray(sinks),
    )
    return mx.array(out)


def enabled(env: dict[str, str] | None = None) -> bool:
    value = (os.environ if env is None else env).get(ATTENTION_ENV, "").strip().lower()
    return value not in OFF_VALUES


def install(model: Any) -> list[str]:
    """Point the modules that define the model's layers at the numpy-backed attention, where
    they use mlx-lm's own (``from .base import scaled_dot_product_attention``; a model with
    its own attention keeps it). Returns the patched module names. Process-wide for those
    modules, so only for the CPU backend (worker/mlx_lm_hooks.py holds the patch). Call
    :func:`uninstall` to undo."""
    names = {type(m).__module__ for m in model.modules()}
    return patch_attention(names, scaled_dot_product_attention)


def uninstall() -> None:
    """Give every patched module back the attention it had."""
    unpatch_attention()
