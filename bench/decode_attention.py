"""Benchmark: decode steps over long contexts, MLX's attention against the numpy one.

A decode step's attention reads every cached key of every row; on the CPU backend MLX's softmax
runs its ``exp`` on one thread (~18 ns an element) over rows x heads x keys scores, padding
included, while ``worker.cpu.attention`` runs it vectorised and skips the keys a row cannot see
(a short row's left padding beside a long one). Taking a decode step into numpy cuts the step's
lazy graph at every layer (~0.3 ms a layer here), so it pays only from some size on: this
measures where, on the real model with real batch caches (mlx-lm's ``BatchKVCache``, what the
engine decodes with), one forward pass of one token a row, both ways in the same process,
alternating, best of ``--repeats``:

- uniform: ``rows`` rows of ``keys`` cached tokens each;
- mixed: one row of ``keys`` tokens and ``rows - 1`` rows of 64 (left-padded to it, as the
  engine's batch holds a short chat beside a long agent turn).

The rule in ``worker.cpu.attention.wanted`` (``MIN_DECODE_ROWS``, ``MIN_DECODE_SCORES``) is read
off this table.

    python bench/decode_attention.py [--model DIR] [--repeats 7]

Run it with the OpenBLAS preload like a worker (``worker.cpu.fast_path.preload_env``); writes
``bench/results/decode-attention.md``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "decode-attention.md"
DEFAULT_MODEL = Path.home() / ".mlx-mesh" / "models" / "smollm2-135m"
SHORT = 64
GRID = [
    ("uniform", 1, 2000),
    ("uniform", 1, 4000),
    ("uniform", 1, 8000),
    ("uniform", 2, 1000),
    ("uniform", 2, 2000),
    ("uniform", 2, 4000),
    ("uniform", 4, 500),
    ("uniform", 4, 1000),
    ("uniform", 4, 2000),
    ("uniform", 4, 4000),
    ("mixed", 2, 2000),
    ("mixed", 4, 2000),
    ("mixed", 4, 4000),
]


def prefilled(model: Any, length: int) -> list[Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    layers = [KVCache() for _ in model.layers]
    for start in range(0, length, 512):
        chunk = [10 + (i % 4000) for i in range(start, min(start + 512, length))]
        model(mx.array([chunk]), cache=layers)
        mx.eval([c.state for c in layers])
    return layers


def batch_cache(model: Any, kind: str, rows: int, keys: int) -> list[Any]:
    from mlx_lm.models.cache import BatchKVCache

    long = prefilled(model, keys)
    if kind == "uniform":
        return [BatchKVCache.merge([c] * rows) for c in long]
    short = prefilled(model, SHORT)
    return [BatchKVCache.merge([a] + [b] * (rows - 1)) for a, b in zip(long, short, strict=True)]


def step_ms(model: Any, cache: list[Any], rows: int, repeats: int) -> dict[str, float]:
    """Best decode step each way, alternating (a slow moment hits both)."""
    import mlx.core as mx

    from worker.cpu import attention as cpu_attention

    best = {"mlx": float("inf"), "numpy": float("inf")}
    saved = cpu_attention.MIN_DECODE_ROWS, cpu_attention.MIN_DECODE_SCORES
    try:
        for _ in range(repeats):
            for mode in best:
                if mode == "mlx":
                    cpu_attention.MIN_DECODE_ROWS = 1 << 30
                else:
                    cpu_attention.MIN_DECODE_ROWS, cpu_attention.MIN_DECODE_SCORES = 1, 0
                start = time.perf_counter()
                mx.eval(model(mx.array([[5]] * rows), cache=cache))
                best[mode] = min(best[mode], (time.perf_counter() - start) * 1000)
                for c in cache:
                    c.trim(1)
    finally:
        cpu_attention.MIN_DECODE_ROWS, cpu_attention.MIN_DECODE_SCORES = saved
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    from worker.cpu import attention as cpu_attention
    from worker.engine.load import load_model
    from worker.engine.types import EngineConfig

    model, _, _, fast_path = load_model(args.model, None, EngineConfig())
    rows_out = []
    for kind, rows, keys in GRID:
        times = step_ms(model, batch_cache(model, kind, rows, keys), rows, args.repeats)
        taken = cpu_attention.decode_in_numpy(rows, keys)
        rows_out.append((kind, rows, keys, times["mlx"], times["numpy"], taken))
        print(kind, rows, keys, {k: round(v, 1) for k, v in times.items()}, taken, flush=True)
    blas = fast_path.as_dict()["blas"] if fast_path else None
    lines = [
        "# Decode steps over long contexts: MLX attention vs numpy",
        "",
        f"`python bench/decode_attention.py --repeats {args.repeats}` on {platform.machine()} "
        f"{platform.system()}, model `{Path(args.model).name}`, CPU backend, BLAS {blas}. One "
        "forward pass of one token a row on a `BatchKVCache`, best of the repeats, both ways "
        "alternating in one process. Mixed: one row of the keys, the others 64 tokens "
        "left-padded to it. Taken: what `worker.cpu.attention.wanted` picks for that step.",
        "",
        "| cache | rows | keys | MLX ms | numpy ms | MLX / numpy | taken |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, rows, keys, mlx_ms, numpy_ms, taken in rows_out:
        lines.append(
            f"| {kind} | {rows} | {keys} | {mlx_ms:.1f} | {numpy_ms:.1f} | "
            f"{mlx_ms / numpy_ms:.2f} | {'numpy' if taken else 'MLX'} |"
        )
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
