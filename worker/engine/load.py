"""Loading the engine's model on its owner thread, and the generator that steps its jobs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from worker.cpu.fast_path import CpuFastPath, prepare_cpu_model
from worker.engine.types import EngineConfig
from worker.speculative.batch import SpeculationStats, install
from worker.speculative.drafts import DraftSource

Loader = Callable[[str], tuple[Any, Any, dict[str, Any]]]


def load_model(
    path: str, loader: Loader | None, config: EngineConfig
) -> tuple[Any, Any, dict[str, Any], CpuFastPath | None]:
    """(model, tokenizer, config, CPU fast path) from ``path`` through ``loader`` (mlx_lm.load
    by default); on the CPU backend in float32 and with the fast path prepared (worker/cpu/fast_path.py)."""
    import mlx.core as mx
    from mlx_lm import load

    if loader is not None:
        model, tokenizer, model_config = loader(path)
    else:
        model, tokenizer, model_config = load(path, return_config=True)
    fast_path = None
    if mx.default_device() == mx.cpu:
        if config.cpu_float32:
            model.set_dtype(mx.float32)
            mx.eval(model.parameters())
        fast_path = prepare_cpu_model(model, max_share=config.cpu_dequantize_share)
    return model, tokenizer, model_config, fast_path


def can_batch(model: Any, config: EngineConfig) -> bool:
    """Whether jobs can share ``model`` in one batch: batching is on and its cache merges."""
    from mlx_lm.models.cache import make_prompt_cache

    return config.batching and all(hasattr(c, "merge") for c in make_prompt_cache(model))


def make_generator(
    model: Any,
    tokenizer: Any,
    config: EngineConfig,
    *,
    batchable: bool,
    stream: Any,
    speculation: SpeculationStats | None = None,
    source: DraftSource | None = None,
) -> Any:
    """mlx-lm's ``BatchGenerator`` for a model that batches (speculating unless the config says
    "off": worker/speculative/batch.py; drafting from ``source``, prompt lookup by default), else ``SequentialGenerator`` (which never speculates: the
    models it serves have caches that cannot hand back a rejected draft's tail)."""
    from mlx_lm.generate import BatchGenerator

    from worker.engine.sequential import SequentialGenerator

    if batchable:
        generator = BatchGenerator(
            model,
            completion_batch_size=config.completion_batch_size,
            prefill_batch_size=config.prefill_batch_size,
            prefill_step_size=config.prefill_step_size,
            stream=stream,
        )
        if config.speculation.on:
            install(generator, config.speculation, speculation or SpeculationStats(), source)
        return generator
    return SequentialGenerator(
        model,
        eos_token_ids=set(tokenizer.eos_token_ids),
        stream=stream,
        prefill_step_size=config.prefill_step_size,
    )


def weight_bytes(model: Any) -> int:
    """What the model's parameters take in memory, as loaded."""
    from mlx.utils import tree_flatten

    return sum(int(v.nbytes) for _, v in tree_flatten(model.parameters()))


def kv_bytes_per_token(model: Any) -> int | None:
    """The KV bytes one more token of context costs, measured: one token through a fresh cache,
    whose layers allocate a step of positions at once (None: a model that cannot say)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    try:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([[0]]), cache=cache))
        total = 0.0
        for layer in cache:
            keys = getattr(layer, "keys", None)
            if keys is None or not getattr(layer, "nbytes", 0):
                return None
            total += layer.nbytes / keys.shape[2]
        return max(1, round(total))
    except Exception:  # a model whose cache is not plain (split ranks pass a budget of 0)
        return None
