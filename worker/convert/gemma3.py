"""The ``gemma3`` GGUF architecture (Gemma 3 text models) → mlx-lm ``gemma3_text``.

llama.cpp's conventions undone here: it stores RMSNorm weights with Gemma's ``1 +`` already
added (mlx-lm adds it at run time, so we subtract it). Q/K are not permuted (Gemma uses NeoX
rope). The embedding scale (sqrt(hidden)) and the local/global attention pattern live in the
model code, so only their parameters go into the config.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import mlx.core as mx

from worker.convert.arch import Architecture, f32, map_tensor_name, meta, transformer_dims
from worker.convert.gguf_file import GGUFFile
from worker.convert.quant import Converted, QuantizedTensor

ARCH = "gemma3"
# llama.cpp hard-codes these for gemma3 rather than storing them.
SLIDING_WINDOW_PATTERN = 6
LOCAL_ROPE_BASE = 10_000.0

TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
}
BLOCK = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def make_config(gguf: GGUFFile) -> dict[str, Any]:
    dims = transformer_dims(gguf, ARCH)
    tokens = gguf.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        **dims,
        # llama.cpp scales queries by 1/sqrt(head_dim) for gemma3, i.e. this scalar.
        "query_pre_attn_scalar": dims["head_dim"],
        "rms_norm_eps": f32(meta(gguf, ARCH, "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": f32(meta(gguf, ARCH, "rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": LOCAL_ROPE_BASE,
        "sliding_window": int(meta(gguf, ARCH, "attention.sliding_window", 512)),
        "sliding_window_pattern": SLIDING_WINDOW_PATTERN,
        "max_position_embeddings": int(meta(gguf, ARCH, "context_length", 32768)),
        "vocab_size": len(tokens) or 262144,
        "tie_word_embeddings": True,
    }
    if gguf.get(f"{ARCH}.rope.scaling.type") == "linear":
        factor = float(meta(gguf, ARCH, "rope.scaling.factor", 1.0))
        config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    return config


def transform(name: str, value: Converted, config: dict[str, Any]) -> Converted:
    if name.endswith("norm.weight") and not isinstance(value, QuantizedTensor):
        return value - 1.0
    return value


GEMMA3 = Architecture(
    gguf_name=ARCH,
    # Gemma's activations overflow float16; bfloat16 has float32's range.
    dtype=mx.bfloat16,
    make_config=make_config,
    tensor_name=partial(map_tensor_name, top=TOP_LEVEL, block=BLOCK, skip=frozenset()),
    transform=transform,
)
