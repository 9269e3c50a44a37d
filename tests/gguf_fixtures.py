"""Write tiny GGUF files the way llama.cpp does, from known weights, for converter tests.

``write_gguf`` takes Hugging Face-layout float weights (what an mlx-lm model holds) and applies
llama.cpp's storage conventions – llama Q/K rows permuted for interleaved rope, gemma norms
stored with ``+1`` – then quantizes each tensor to the requested GGML type. A converter that
undoes all of that reproduces the source model's logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import quantize

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = ["the", "hello", "world", "model", "tiny", "test", "in", "er", "on"]


@dataclass
class TinyConfig:
    arch: str = "llama"
    hidden: int = 64
    intermediate: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    context: int = 256
    rope_base: float = 10000.0
    eps: float = 1e-5
    tied: bool = True
    tokens: list[str] = field(default_factory=list)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (byte-level BPE alphabet)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


def byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """Tokens, merges and token types of a small byte-level BPE vocabulary."""
    alphabet = sorted(_bytes_to_unicode().values())
    tokens = [*SPECIALS, *alphabet]
    merges: list[str] = []
    for word in WORDS:
        current = word[0]
        for ch in word[1:]:
            merged = current + ch
            if merged not in tokens:
                merges.append(f"{current} {ch}")
                tokens.append(merged)
            current = merged
        merges.append(f"Ġ {word}")
        tokens.append("Ġ" + word)
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, merges, types


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types of a small SentencePiece (gemma-style) vocabulary."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2, 3, 3]
    scores = [0.0] * len(tokens)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    scores += [0.0] * 256
    pieces: list[str] = []
    for ch in "▁abcdefghijklmnopqrstuvwxyz.,!?":
        pieces.append(ch)
    for word in WORDS:
        text = "▁" + word
        for end in range(2, len(text) + 1):
            if text[:end] not in pieces:
                pieces.append(text[:end])
    for rank, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(1)
        # Longer (later) pieces merge later: lower score.
        scores.append(-float(rank))
    return tokens, scores, types


def random_weights(cfg: TinyConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-layout float32 weights for ``cfg`` (llama or gemma3 parameter names)."""
    rng = np.random.default_rng(seed)
    h, hd, n = cfg.hidden, cfg.head_dim, len(cfg.tokens)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)

    def norm(size: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(n, h), "model.norm.weight": norm(h)}
    if not cfg.tied:
        w["lm_head.weight"] = mat(n, h)
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = mat(cfg.heads * hd, h)
        w[p + "self_attn.k_proj.weight"] = mat(cfg.kv_heads * hd, h)
        w[p + "self_attn.v_proj.weight"] = mat(cfg.kv_heads * hd, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, cfg.heads * hd)
        w[p + "mlp.gate_proj.weight"] = mat(cfg.intermediate, h)
        w[p + "mlp.up_proj.weight"] = mat(cfg.intermediate, h)
        w[p + "mlp.down_proj.weight"] = mat(h, cfg.intermediate)
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        if cfg.arch == "gemma3":
            w[p + "pre_feedforward_layernorm.weight"] = norm(h)
            w[p + "post_feedforward_layernorm.weight"] = norm(h)
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
    return w


_BLOCK_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
_LLAMA_BLOCK = {**_BLOCK_NAMES, "post_attention_layernorm": "ffn_norm"}
_GEMMA_BLOCK = {
    **_BLOCK_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str, arch: str) -> str:
    if hf_name in _TOP:
        return _TOP[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module = rest.removesuffix(".weight")
    table = _GEMMA_BLOCK if arch == "gemma3" else _LLAMA_BLOCK
    return f"blk.{layer}.{table[module]}.weight"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to llama Q/K rows (rotate-half → interleaved)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def default_types(hf_name: str) -> QT:
    """A mix like real files: 8-bit embedding, 4-bit attention, Q4_1 and Q5_0 in the MLP."""
    if hf_name.endswith("norm.weight"):
        return QT.F32
    if "embed_tokens" in hf_name:
        return QT.Q8_0
    if "gate_proj" in hf_name or "up_proj" in hf_name:
        return QT.Q4_1
    if "down_proj" in hf_name:
        return QT.Q5_0
    if "lm_head" in hf_name:
        return QT.F16
    return QT.Q4_0


def gguf_tensors(
    cfg: TinyConfig, weights: dict[str, np.ndarray], types=default_types
) -> dict[str, tuple[np.ndarray, QT]]:
    """GGUF name → (stored float values before quantization, GGML type)."""
    out = {}
    for hf_name, value in weights.items():
        stored = value
        if cfg.arch == "llama" and hf_name.endswith("q_proj.weight"):
            stored = llama_cpp_permute(value, cfg.heads)
        elif cfg.arch == "llama" and hf_name.endswith("k_proj.weight"):
            stored = llama_cpp_permute(value, cfg.kv_heads)
        elif cfg.arch == "gemma3" and hf_name.endswith("norm.weight"):
            stored = value + 1.0
        out[gguf_name(hf_name, cfg.arch)] = (stored, types(hf_name))
    return out


def write_gguf(
    path: Path, cfg: TinyConfig, weights: dict[str, np.ndarray], types=default_types
) -> Path:
    """Write ``weights`` (HF layout) as a GGUF of architecture ``cfg.arch`` with a tokenizer."""
    arch = cfg.arch
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.layers)
    writer.add_context_length(cfg.context)
    writer.add_embedding_length(cfg.hidden)
    writer.add_feed_forward_length(cfg.intermediate)
    writer.add_head_count(cfg.heads)
    writer.add_head_count_kv(cfg.kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_base)
    writer.add_layer_norm_rms_eps(cfg.eps)
    if arch == "llama":
        tokens, merges, token_types = byte_level_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(token_types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHATML)
    else:
        tokens, scores, token_types = sentencepiece_vocab()
        writer.add_sliding_window(8)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(token_types)
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(False)
    for name, (values, qtype) in gguf_tensors(cfg, weights, types).items():
        if qtype == QT.F32:
            writer.add_tensor(name, values.astype(np.float32))
        elif qtype == QT.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_config(arch: str = "llama", tied: bool = True) -> TinyConfig:
    """A tiny config whose vocabulary matches the tokenizer ``write_gguf`` stores."""
    tokens = byte_level_vocab()[0] if arch == "llama" else sentencepiece_vocab()[0]
    if arch == "gemma3":
        # Six layers: gemma3 alternates five sliding-window layers with one global layer.
        return TinyConfig(
            arch=arch, layers=6, heads=2, kv_heads=1, head_dim=32, eps=1e-6, tokens=tokens
        )
    return TinyConfig(arch=arch, tied=tied, tokens=tokens)


def make_tiny_gguf(path: Path, arch: str = "llama", tied: bool = True, seed: int = 0):
    """Write a tiny GGUF; returns (path, config, HF-layout weights it was made from)."""
    cfg = tiny_config(arch, tied)
    weights = random_weights(cfg, seed)
    write_gguf(path, cfg, weights)
    return path, cfg, weights
