"""The ``llama`` GGUF architecture (Llama 1-3, SmolLM, Mistral-like dense models) → mlx-lm."""

from __future__ import annotations

from functools import partial
from typing import Any

import mlx.core as mx
import numpy as np

from worker.convert.arch import Architecture, f32, map_tensor_name, meta, transformer_dims
from worker.convert.gguf_file import GGUFFile
from worker.convert.quant import Converted, QuantizedTensor, to_float

ARCH = "llama"

TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# rope_freqs carries llama3 rope scaling, which goes into the config instead.
SKIP = frozenset({"rope_freqs.weight"})


def make_config(gguf: GGUFFile) -> dict[str, Any]:
    tokens = gguf.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        **transformer_dims(gguf, ARCH),
        "rms_norm_eps": f32(meta(gguf, ARCH, "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": f32(meta(gguf, ARCH, "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta(gguf, ARCH, "context_length", 4096)),
        "vocab_size": int(meta(gguf, ARCH, "vocab_size", len(tokens) or 32000)),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "mlp_bias": "blk.0.ffn_gate.bias" in gguf.tensors,
    }
    rope_scaling = _rope_scaling(gguf)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(gguf: GGUFFile) -> dict[str, Any] | None:
    if "rope_freqs.weight" in gguf.tensors:
        # llama.cpp bakes llama3 scaling into per-frequency factors; the largest is the factor.
        factors = to_float(gguf.tensors["rope_freqs.weight"])
        return {
            "rope_type": "llama3",
            "factor": float(factors.max()),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": int(
                meta(gguf, ARCH, "rope.scaling.original_context_length", 8192)
            ),
        }
    kind = gguf.get(f"{ARCH}.rope.scaling.type")
    if kind == "linear":
        return {"type": "linear", "factor": float(meta(gguf, ARCH, "rope.scaling.factor", 1.0))}
    return None


def unpermute_order(rows: int, n_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation (HF rotate-half → interleaved rope).

    llama.cpp stores row (head, i, pair) of the HF matrix's (head, pair, i); with rows taken in
    this order, mlx-lm's default (non-traditional) rope gives the same attention.
    """
    head_dim = rows // n_heads
    order = np.arange(rows).reshape(n_heads, head_dim // 2, 2)
    return order.swapaxes(1, 2).reshape(-1)


def transform(name: str, value: Converted, config: dict[str, Any]) -> Converted:
    if ".self_attn.q_proj." in name:
        heads = config["num_attention_heads"]
    elif ".self_attn.k_proj." in name:
        heads = config["num_key_value_heads"]
    else:
        return value
    if isinstance(value, QuantizedTensor):
        return value.take_rows(unpermute_order(value.weight.shape[0], heads))
    return value[mx.array(unpermute_order(value.shape[0], heads))]


LLAMA = Architecture(
    gguf_name=ARCH,
    dtype=mx.float16,
    make_config=make_config,
    tensor_name=partial(map_tensor_name, top=TOP_LEVEL, block=BLOCK, skip=SKIP),
    transform=transform,
)
