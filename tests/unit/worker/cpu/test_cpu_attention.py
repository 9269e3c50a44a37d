"""worker/cpu/attention.py: numpy attention for CPU prefill chunks equals MLX's, for every mask
form the engine passes, and the engine says the same greedy tokens with it as without it."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base
from mlx_lm.models.base import create_causal_mask

from worker.chat.prompt import ChatTemplate
from worker.cpu import attention as cpu_attention
from worker.cpu import fast_path as cpu
from worker.engine.core import Engine
from worker.engine.types import EngineConfig, GenerationRequest
from worker.sampling import SamplingParams
from worker.testing import collect_logprobs, make_tiny_gemma3_model

rng = np.random.default_rng(7)


def _normal(*shape: int) -> mx.array:
    return mx.array(rng.normal(size=shape).astype(np.float32))


def _masks(batch: int, heads: int, length: int, keys: int) -> dict[str, Any]:
    offset = keys - length
    return {
        "none": None,
        "causal": "causal",
        # BatchKVCache's form; the second row's padding (offset + 8) leaves its first 8 queries
        # seeing no key at all, which MLX answers with a uniform average.
        "left-padded": create_causal_mask(
            length, offset, left_padding=mx.array([0, offset + 8][:batch])
        ),
        "sliding": create_causal_mask(length, offset, window_size=9),
        "additive": _normal(batch, 1, length, keys),
        "per-head": mx.array(rng.random((batch, heads, length, keys)) > 0.3),
        "2-d": create_causal_mask(length, offset),
    }


def _mlx(q: mx.array, k: mx.array, v: mx.array, mask: Any, sinks: Any) -> np.ndarray:
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask, sinks=sinks)
    return np.asarray(out)


def _numpy(q: mx.array, k: mx.array, v: mx.array, mask: Any, sinks: Any, **kw: Any) -> np.ndarray:
    return cpu_attention.attention(
        np.asarray(q),
        np.asarray(k),
        np.asarray(v),
        0.3,
        np.asarray(mask) if isinstance(mask, mx.array) else mask,
        None if sinks is None else np.asarray(sinks),
        **kw,
    )


@pytest.mark.parametrize("mask_name", list(_masks(2, 4, 37, 57)))
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (6, 2), (3, 3)])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_numpy_attention_equals_mlx(mask_name: str, heads: int, kv_heads: int, sinks: bool) -> None:
    batch, length, keys = 2, 37, 57  # 37 queries in tiles of 8: a short last tile
    q = _normal(batch, heads, length, 16)
    k, v = _normal(batch, kv_heads, keys, 16), _normal(batch, kv_heads, keys, 16)
    mask = _masks(batch, heads, length, keys)[mask_name]
    sink = _normal(heads) if sinks else None
    expected = _mlx(q, k, v, mask, sink)
    got = _numpy(q, k, v, mask, sink, row_block=8)
    assert got.shape == expected.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize("mask_name", ["none", "causal", "left-padded", "additive", "per-head"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4)])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("keys", [40, 700])  # one part a row; several parts merged
def test_numpy_decode_equals_mlx(
    mask_name: str, heads: int, kv_heads: int, sinks: bool, keys: int
) -> None:
    """One query a row: the keys split into parts over the threads and merged. Left-padded:
    the second row sees no key at all (MLX: a uniform average)."""
    batch = 2
    q = _normal(batch, heads, 1, 16)
    k, v = _normal(batch, kv_heads, keys, 16), _normal(batch, kv_heads, keys, 16)
    masks = _masks(batch, heads, 1, keys)
    masks["left-padded"] = create_causal_mask(1, keys - 1, left_padding=mx.array([5, keys]))
    mask = masks[mask_name]
    sink = _normal(heads) if sinks else None
    expected = _mlx(q, k, v, mask, sink)
    got = _numpy(q, k, v, mask, sink)
    assert got.shape == expected.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6)


def test_decode_takes_numpy_for_several_rows_over_long_contexts_only() -> None:
    assert cpu_attention.decode_in_numpy(4, 2000) and cpu_attention.decode_in_numpy(2, 4000)
    assert not cpu_attention.decode_in_numpy(1, 8000)  # one row: measured no steady gain
    assert not cpu_attention.decode_in_numpy(4, 1000)  # the graph cuts cost more


def test_a_batched_decode_step_over_a_long_context_takes_numpy_and_matches_mlx(
    numpy_calls: list[tuple[int, ...]],
) -> None:
    rows, keys = 4, 2000
    q, k, v = _normal(rows, 4, 1, 16), _normal(rows, 2, keys, 16), _normal(rows, 2, keys, 16)
    mask = create_causal_mask(1, keys - 1, left_padding=mx.array([0, 1900, 30, 2]))
    got = cpu_attention.scaled_dot_product_attention(q, k, v, None, 0.3, mask)
    assert numpy_calls == [(rows, 4, 1, 16)]
    np.testing.assert_allclose(np.asarray(got), _mlx(q, k, v, mask, None), rtol=0, atol=2e-6)


def test_keys_read_in_place_from_a_larger_cache_buffer() -> None:
    """KVCache hands attention a slice of its buffer: strided, not copied."""
    buffer_k, buffer_v = _normal(1, 2, 256, 16), _normal(1, 2, 256, 16)
    k, v = buffer_k[..., :100, :], buffer_v[..., :100, :]
    q = _normal(1, 4, 40, 16)
    mx.eval(k, v)
    got = cpu_attention.attention(np.asarray(q), np.asarray(k), np.asarray(v), 0.3, "causal")
    np.testing.assert_allclose(got, _mlx(q, k, v, "causal", None), rtol=0, atol=2e-6)


# ---- the hook ----------------------------------------------------------------------------


@pytest.fixture
def numpy_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The query shapes the numpy path served."""
    calls: list[tuple[int, ...]] = []
    real = cpu_attention.attention

    def spy(queries: np.ndarray, *args: Any, **kwargs: Any) -> np.ndarray:
        calls.append(queries.shape)
        return real(queries, *args, **kwargs)

    monkeypatch.setattr(cpu_attention, "attention", spy)
    return calls


class QuantizedCache:
    bits = 8
    group_size = 64


def test_prefill_chunks_take_numpy_and_match_mlx(numpy_calls: list[tuple[int, ...]]) -> None:
    q, k, v = _normal(1, 4, 64, 16), _normal(1, 2, 96, 16), _normal(1, 2, 96, 16)
    mask = create_causal_mask(64, 32, left_padding=mx.array([3]))
    got = cpu_attention.scaled_dot_product_attention(q, k, v, None, 0.3, mask)
    assert isinstance(got, mx.array) and got.dtype == mx.float32
    assert numpy_calls == [(1, 4, 64, 16)]
    np.testing.assert_allclose(np.asarray(got), _mlx(q, k, v, mask, None), rtol=0, atol=2e-6)


def test_a_verify_pass_over_a_long_context_takes_numpy_and_matches_mlx(
    numpy_calls: list[tuple[int, ...]],
) -> None:
    """4 rows x 9 queries (a sampled token and 8 drafted ones) over 1,500 keys, left padding
    in the mask as a batch cache makes it: its softmax is worth the numpy path."""
    rows, width, keys = 4, 9, 1500
    q, k, v = _normal(rows, 4, width, 16), _normal(rows, 2, keys, 16), _normal(rows, 2, keys, 16)
    mask = create_causal_mask(width, keys - width, left_padding=mx.array([0, 7, 30, 2]))
    assert rows * width * keys >= cpu_attention.MIN_SCORES
    got = cpu_attention.scaled_dot_product_attention(q, k, v, None, 0.3, mask)
    assert numpy_calls == [(rows, 4, width, 16)]
    np.testing.assert_allclose(np.asarray(got), _mlx(q, k, v, mask, None), rtol=0, atol=2e-6)


@pytest.mark.parametrize(
    "case", ["decode", "short chunk", "quantized cache", "bfloat16", "int mask", "wrong sinks"]
)
def test_everything_else_stays_on_mlx(case: str, numpy_calls: list[tuple[int, ...]]) -> None:
    length = 1 if case == "decode" else 8 if case == "short chunk" else 64
    q, k, v = _normal(1, 4, length, 16), _normal(1, 2, 96, 16), _normal(1, 2, 96, 16)
    mask: Any = None if length == 1 else "causal"
    sinks = _normal(2) if case == "wrong sinks" else None
    if case == "bfloat16":
        q, k, v = (a.astype(mx.bfloat16) for a in (q, k, v))
    if case == "int mask":
        mask = mx.zeros((length, 96), dtype=mx.int32)
    cache = QuantizedCache() if case == "quantized cache" else None
    assert not cpu_attention.wanted(q, k, v, cache, mask, sinks)
    if case not in ("quantized cache", "wrong sinks", "int mask"):
        got = cpu_attention.scaled_dot_product_attention(q, k, v, cache, 0.3, mask)
        expected = base.scaled_dot_product_attention(q, k, v, cache, 0.3, mask)
        assert mx.array_equal(got, expected)  # MLX's own, bit for bit
    assert numpy_calls == []


@pytest.fixture
def unhooked() -> Iterator[None]:
    """Every test leaves mlx-lm's modules as it found them (the hook is process-wide)."""
    cpu_attention.uninstall()
    yield
    cpu_attention.uninstall()


def test_install_patches_the_models_module_and_uninstall_restores_it(
    tiny_model_dir: Path, unhooked: None
) -> None:
    from mlx_lm import load
    from mlx_lm.models import llama

    model = load(str(tiny_model_dir))[0]
    original = base.scaled_dot_product_attention
    assert llama.scaled_dot_product_attention is original
    assert cpu_attention.install(model) == ["mlx_lm.models.llama"]
    assert llama.scaled_dot_product_attention is cpu_attention.scaled_dot_product_attention
    assert cpu_attention.install(model) == ["mlx_lm.models.llama"]  # twice: still one hook
    cpu_attention.uninstall()
    assert llama.scaled_dot_product_attention is original


def test_fast_path_installs_it_unless_turned_off(
    tiny_model_dir: Path, unhooked: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlx_lm import load
    from mlx_lm.models import llama

    monkeypatch.setenv(cpu_attention.ATTENTION_ENV, "off")
    off = cpu.prepare_cpu_model(load(str(tiny_model_dir))[0])
    assert off.as_dict()["attention"] == "mlx"
    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention
    monkeypatch.delenv(cpu_attention.ATTENTION_ENV)
    on = cpu.prepare_cpu_model(load(str(tiny_model_dir))[0])
    assert on.as_dict()["attention"] == "numpy"
    assert (
        "cpu attention: numpy for chunks of 32+ tokens, long verify passes and batched long"
        " decode steps (llama)" in on.lines()
    )


# ---- the engine: same greedy tokens with the hook as without ------------------------------

STEP = 64  # prefill chunks of 64 tokens: every chunk takes the numpy path
GREEDY = SamplingParams(temperature=0.0)


def _prompts(engine: Engine, lengths: tuple[int, ...]) -> list[list[int]]:
    text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(80))
    prompt, _ = ChatTemplate(engine.tokenizer).render([{"role": "user", "content": text}], None, {})
    assert len(prompt) >= max(lengths)
    return [prompt[i : i + n] for i, n in enumerate(lengths)]  # no shared prefix


def _mixing(model_dir: Path, path: Path) -> Path:
    """``model_dir``'s llama with MLX's own random weights: the fixture's weights make each next
    token depend on the current one alone (by design), which would hide a wrong attention."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    shutil.copytree(model_dir, path)
    config = json.loads((path / "config.json").read_text())
    mx.random.seed(3)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return path


async def _greedy(model_dir: Path, lengths: tuple[int, ...], batching: bool) -> list[list[str]]:
    """Each prompt's greedy tokens, the prompts submitted together: one left-padded batch
    (boolean masks) or, not batching, one after the other ("causal" masks)."""
    config = EngineConfig(prefill_step_size=STEP, batching=batching)
    engine = Engine(str(model_dir), config=config)
    engine.start(timeout=60)
    try:
        jobs = [
            engine.submit(GenerationRequest(p, 16, GREEDY, logprobs=True))
            for p in _prompts(engine, lengths)
        ]
        done = await asyncio.gather(*(collect_logprobs(engine, job) for job in jobs))
        return [[text for text, _ in tokens] for tokens, _ in done]
    finally:
        engine.close()


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "sequential"])
@pytest.mark.parametrize("model", ["llama", "llama-sliding", "gemma3"])
async def test_engine_says_the_same_with_and_without_numpy_attention(
    model: str,
    batching: bool,
    tiny_model_dir: Path,
    sliding_model_dir: Path,
    tmp_path: Path,
    unhooked: None,
    numpy_calls: list[tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if model == "gemma3":
        model_dir = make_tiny_gemma3_model(tmp_path / "gemma3", sliding_window=16)
    else:
        source = sliding_model_dir if model == "llama-sliding" else tiny_model_dir
        model_dir = _mixing(source, tmp_path / model)
    lengths = (300, 181)  # several chunks each, the shorter one left-padded in the batch

    with_numpy = await _greedy(model_dir, lengths, batching)
    # Prefill chunks and verify passes; never a decode step (it keeps its pipelined graph).
    assert numpy_calls and all(shape[2] > 1 for shape in numpy_calls)
    cpu_attention.uninstall()
    monkeypatch.setenv(cpu_attention.ATTENTION_ENV, "off")
    calls = len(numpy_calls)
    with_mlx = await _greedy(model_dir, lengths, batching)
    assert len(numpy_calls) == calls  # the second run was MLX's own

    assert with_numpy == with_mlx
    assert all(len(tokens) == 16 for tokens in with_mlx)
