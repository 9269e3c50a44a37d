"""Convert one GGUF file into an mlx-lm model directory (config, safetensors, tokenizer)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.utils import load_model

from worker.convert.arch import Architecture
from worker.convert.errors import ConvertError, CorruptGGUFError, UnsupportedModelError
from worker.convert.gemma3 import GEMMA3
from worker.convert.gguf_file import GGUFFile
from worker.convert.llama import LLAMA
from worker.convert.progress import NullProgress, Progress
from worker.convert.quant import GROUP_SIZE, QuantizedTensor, convert_tensor
from worker.convert.tokenizer import build_tokenizer
from worker.split.layout import write_index

ARCHITECTURES: dict[str, Architecture] = {a.gguf_name: a for a in (LLAMA, GEMMA3)}

# Layers mlx-lm builds as nn.Linear / nn.Embedding, i.e. the ones that can stay quantized.
_QUANTIZABLE_SUFFIXES = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")


def default_dtype(arch: Architecture) -> mx.Dtype:
    """The architecture's half-precision dtype on Metal; float32 on CPU.

    MLX's CPU backend runs float16/bfloat16 matmuls and quantized matmuls with half-precision
    scales ~80x slower than float32 (measured: 11.8 s vs 0.15 s per token for a 135M model).
    """
    return arch.dtype if mx.metal.is_available() else mx.float32


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    progress: Progress | None = None,
    dtype: mx.Dtype | None = None,
) -> None:
    """Write an mlx-lm-loadable model converted from ``gguf_path`` into ``out_dir``.

    ``dtype`` is the one for norms, unquantized weights and quantization scales (default:
    :func:`default_dtype`).

    ``out_dir`` must exist (and be empty); on error it may hold partial files, so callers convert
    into a scratch directory and move it into place afterwards (see ``worker.store``).
    Raises :class:`~worker.convert.errors.ConvertError` for anything wrong with the input.
    """
    progress = progress or NullProgress()
    progress.stage(f"Reading {gguf_path.name}")
    gguf = GGUFFile(gguf_path)
    try:
        _convert(gguf, out_dir, progress, dtype)
    except (ValueError, KeyError, IndexError, TypeError, ZeroDivisionError, OverflowError) as exc:
        # Metadata that parses but does not describe a consistent model (a corrupt count, a
        # tensor of the wrong shape) surfaces as one of these from numpy, mlx or mlx-lm.
        raise ConvertError(
            f"{gguf_path}: inconsistent model ({type(exc).__name__}: {exc})"
        ) from exc


def _convert(gguf: GGUFFile, out_dir: Path, progress: Progress, dtype: mx.Dtype | None) -> None:
    arch = ARCHITECTURES.get(gguf.architecture)
    if arch is None:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedModelError(
            f"architecture {gguf.architecture!r} is not supported (supported: {supported})"
        )
    dtype = dtype or default_dtype(arch)
    config = arch.make_config(gguf)
    progress.stage("Building tokenizer")
    tokenizer, tokenizer_config = build_tokenizer(gguf)

    weights: dict[str, mx.array] = {}
    layer_quant: dict[str, dict[str, int]] = {}
    progress.stage("Converting tensors", total=len(gguf.tensors))
    for tensor in gguf.tensors.values():
        name = arch.tensor_name(tensor.name)
        if name is not None:
            quantizable = name.endswith(_QUANTIZABLE_SUFFIXES)
            value = arch.transform(name, convert_tensor(tensor, dtype, quantizable), config)
            if isinstance(value, QuantizedTensor):
                module = name.removesuffix(".weight")
                arrays = {
                    f"{module}.weight": value.weight,
                    f"{module}.scales": value.scales,
                    f"{module}.biases": value.biases,
                }
                layer_quant[module] = {"group_size": value.group_size, "bits": value.bits}
            else:
                arrays = {name: value}
            # Evaluate now so peak memory stays near one tensor, not the whole model twice.
            mx.eval(list(arrays.values()))
            weights.update(arrays)
        progress.advance()

    _check_dimensions(config, weights, layer_quant)
    if layer_quant:
        config["quantization"] = quantization_config(layer_quant)
        config["quantization_config"] = config["quantization"]
    eos_ids = _eos_token_ids(gguf, tokenizer.get_vocab())
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    bos = gguf.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = int(bos)

    progress.stage("Writing model")
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    # The weight map lets a split rank see which files hold its layers (mlx-lm reads it too).
    write_index(out_dir)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    specials = {k: v for k, v in tokenizer_config.items() if k.endswith("_token")}
    _write_json(out_dir / "special_tokens_map.json", specials)
    _write_json(out_dir / "config.json", config)

    progress.stage("Checking that mlx-lm loads it")
    # Builds the model from config.json and loads the weights strictly (names and shapes),
    # without evaluating anything: a directory that passes is one the worker can serve.
    load_model(out_dir, lazy=True)


def _logical_shape(
    weights: dict[str, mx.array], layer_quant: dict[str, dict[str, int]], name: str
) -> tuple[int, ...]:
    shape = tuple(weights[name].shape)
    quant = layer_quant.get(name.removesuffix(".weight"))
    if quant is not None:  # packed: 32 // bits values per uint32
        shape = (*shape[:-1], shape[-1] * 32 // quant["bits"])
    return shape


def _check_dimensions(
    config: dict[str, Any], weights: dict[str, mx.array], layer_quant: dict[str, dict[str, int]]
) -> None:
    """The header's sizes must match the tensors before mlx-lm builds a model from them (a
    corrupt layer count would otherwise build millions of layers)."""
    layers = {int(k.split(".")[2]) for k in weights if k.startswith("model.layers.")}
    n_layers = config["num_hidden_layers"]
    if len(layers) != n_layers or layers != set(range(len(layers))):
        raise CorruptGGUFError(
            f"the header says {n_layers} layers but the file has tensors for {len(layers)}"
        )
    heads, kv_heads, head_dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    expected = {
        "model.embed_tokens.weight": (config["vocab_size"], config["hidden_size"]),
        "model.layers.0.self_attn.q_proj.weight": (heads * head_dim, config["hidden_size"]),
        "model.layers.0.self_attn.k_proj.weight": (kv_heads * head_dim, config["hidden_size"]),
        "model.layers.0.mlp.gate_proj.weight": (config["intermediate_size"], config["hidden_size"]),
    }
    for name, shape in expected.items():
        actual = _logical_shape(weights, layer_quant, name) if name in weights else None
        if actual != shape:
            raise CorruptGGUFError(f"{name} has shape {actual}, the header implies {shape}")


def quantization_config(layer_quant: dict[str, dict[str, int]]) -> dict[str, Any]:
    """mlx-lm's ``quantization``: the most common setting plus per-layer overrides."""
    counts = Counter((q["group_size"], q["bits"]) for q in layer_quant.values())
    (group_size, bits), _ = counts.most_common(1)[0]
    config: dict[str, Any] = {"group_size": group_size, "bits": bits}
    for module, q in sorted(layer_quant.items()):
        if (q["group_size"], q["bits"]) != (group_size, bits):
            config[module] = dict(q)
    return config


def _eos_token_ids(gguf: GGUFFile, vocab: dict[str, int]) -> list[int]:
    ids = []
    eos = gguf.get("tokenizer.ggml.eos_token_id")
    if eos is not None:
        ids.append(int(eos))
    eot = gguf.get("tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in ids:
        ids.append(int(eot))
    # Chat models end a turn with these even when the GGUF names only the document end.
    for marker in ("<end_of_turn>", "<|eot_id|>", "<|im_end|>"):
        if (
            marker in vocab
            and vocab[marker] not in ids
            and marker in str(gguf.get("tokenizer.chat_template", ""))
        ):
            ids.append(vocab[marker])
    return ids


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


__all__ = ["ARCHITECTURES", "GROUP_SIZE", "convert_gguf", "default_dtype", "quantization_config"]
