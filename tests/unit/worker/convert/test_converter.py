"""GGUF → MLX conversion on tiny GGUFs written like llama.cpp writes them (tests/gguf_fixtures)."""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize
from gguf_fixtures import (
    TinyConfig,
    gguf_name,
    llama_cpp_permute,
    make_tiny_gguf,
    random_weights,
    tiny_config,
    write_gguf,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.convert import (
    ConvertError,
    CorruptGGUFError,
    UnsupportedModelError,
    convert_gguf,
)
from worker.convert.gguf_file import GGUFFile
from worker.convert.llama import unpermute_order
from worker.convert.tokenizer import is_fallback_template


def _convert(gguf_path: Path, out: Path) -> Path:
    out.mkdir()
    convert_gguf(gguf_path, out, dtype=mx.float32)
    return out


def _all_f32(_name: str) -> QT:
    return QT.F32


def _dequantized(saved: dict[str, mx.array], module: str, config: dict) -> np.ndarray:
    if f"{module}.scales" not in saved:
        return np.array(saved[f"{module}.weight"])
    quant = config["quantization"]
    bits = quant.get(module, quant)["bits"]
    w = mx.dequantize(
        saved[f"{module}.weight"],
        saved[f"{module}.scales"],
        saved[f"{module}.biases"],
        group_size=32,
        bits=bits,
    )
    return np.array(w)


def test_quantized_tensors_keep_their_gguf_values(tmp_path: Path) -> None:
    gguf_path, cfg, weights = make_tiny_gguf(tmp_path / "m.gguf")
    out = _convert(gguf_path, tmp_path / "out")
    saved = mx.load(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    stored = {t.name: t for t in GGUFReader(gguf_path).tensors}
    assert len(stored) == len(weights)
    for hf_name in weights:
        tensor = stored[gguf_name(hf_name, "llama")]
        expected = dequantize(tensor.data, tensor.tensor_type).reshape(weights[hf_name].shape)
        got = _dequantized(saved, hf_name.removesuffix(".weight"), config)
        # Q/K come back in HF row order: permuting them like llama.cpp gives the stored rows.
        if "q_proj" in hf_name:
            got = llama_cpp_permute(got, cfg.heads)
        if "k_proj" in hf_name:
            got = llama_cpp_permute(got, cfg.kv_heads)
        if tensor.tensor_type == QT.Q5_0:
            # Requantized to MLX 5-bit: within one quantization step of the GGUF values.
            step = np.abs(expected).max() / 15
            np.testing.assert_allclose(got, expected, atol=step, err_msg=hf_name)
        else:
            # Q4_0/Q4_1/Q8_0 are repacked bit for bit, floats copied.
            np.testing.assert_allclose(got, expected, atol=1e-6, rtol=1e-6, err_msg=hf_name)


def test_quantization_config_has_per_layer_bits(tmp_path: Path) -> None:
    gguf_path, *_ = make_tiny_gguf(tmp_path / "m.gguf")
    out = _convert(gguf_path, tmp_path / "out")
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert (quant["group_size"], quant["bits"]) == (32, 4)
    assert quant["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert quant["model.layers.1.mlp.down_proj"] == {"group_size": 32, "bits": 5}
    assert "model.layers.0.self_attn.q_proj" not in quant  # the default applies
    saved = mx.load(str(out / "model.safetensors"))
    assert "model.layers.0.input_layernorm.scales" not in saved  # norms stay float


def test_config_comes_from_metadata(tmp_path: Path) -> None:
    gguf_path, cfg, _ = make_tiny_gguf(tmp_path / "m.gguf", tied=False)
    out = _convert(gguf_path, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["hidden_size"] == cfg.hidden
    assert config["intermediate_size"] == cfg.intermediate
    assert config["num_hidden_layers"] == cfg.layers
    assert config["num_attention_heads"] == cfg.heads
    assert config["num_key_value_heads"] == cfg.kv_heads
    assert config["head_dim"] == cfg.head_dim
    assert config["rope_theta"] == cfg.rope_base
    assert config["rms_norm_eps"] == cfg.eps
    assert config["max_position_embeddings"] == cfg.context
    assert config["vocab_size"] == len(cfg.tokens)
    assert config["tie_word_embeddings"] is False
    assert config["eos_token_id"] == 2
    assert "lm_head.weight" in mx.load(str(out / "model.safetensors"))


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    rows = np.arange(4 * 16 * 3).reshape(4 * 16, 3)
    permuted = llama_cpp_permute(rows, 4)
    assert not np.array_equal(permuted, rows)
    np.testing.assert_array_equal(permuted[unpermute_order(64, 4)], rows)


def _source_model(cfg: TinyConfig, weights: dict[str, np.ndarray]):
    """The model the GGUF was made from, built directly with mlx-lm from HF-layout weights."""
    common = dict(
        hidden_size=cfg.hidden,
        num_hidden_layers=cfg.layers,
        intermediate_size=cfg.intermediate,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.eps,
        vocab_size=len(cfg.tokens),
        rope_theta=cfg.rope_base,
    )
    if cfg.arch == "gemma3":
        from mlx_lm.models import gemma3_text as arch

        args = arch.ModelArgs(
            model_type="gemma3_text",
            query_pre_attn_scalar=cfg.head_dim,
            sliding_window=8,
            sliding_window_pattern=6,
            rope_local_base_freq=10000.0,
            **common,
        )
    else:
        from mlx_lm.models import llama as arch

        args = arch.ModelArgs(model_type="llama", tie_word_embeddings=cfg.tied, **common)
    model = arch.Model(args)
    params = model.sanitize({k: mx.array(v) for k, v in weights.items()})
    model.load_weights(list(params.items()))
    return model


@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("llama", False), ("gemma3", True)])
def test_float_model_reproduces_source_logits(tmp_path: Path, arch: str, tied: bool) -> None:
    from mlx_lm import load

    cfg = tiny_config(arch, tied)
    weights = random_weights(cfg, seed=1)
    gguf_path = write_gguf(tmp_path / "m.gguf", cfg, weights, types=_all_f32)
    out = _convert(gguf_path, tmp_path / "out")
    converted, _ = load(str(out))
    source = _source_model(cfg, weights)
    # Long enough to cross gemma3's sliding window (8) and exercise rope at many positions.
    ids = mx.array([[5, 40, 41, 42, 7, 99, 12, 13, 14, 60, 61, 62, 70, 71]])
    np.testing.assert_allclose(
        np.array(converted(ids)), np.array(source(ids)), atol=2e-4, rtol=1e-4
    )


def test_byte_level_tokenizer_round_trips(tmp_path: Path) -> None:
    from mlx_lm import load

    gguf_path, *_ = make_tiny_gguf(tmp_path / "m.gguf")
    _, tokenizer = load(str(_convert(gguf_path, tmp_path / "out")))
    text = "hello the world!\n  Ünïcode ✓ 42 <|im_end|>"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode("hello the"))
    assert pieces == ["hello", "Ġthe"]
    assert tokenizer.encode("<|im_start|>") == [1]  # special tokens are never split
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_sentencepiece_tokenizer_round_trips(tmp_path: Path) -> None:
    from mlx_lm import load

    gguf_path, *_ = make_tiny_gguf(tmp_path / "g.gguf", arch="gemma3")
    _, tokenizer = load(str(_convert(gguf_path, tmp_path / "out")))
    text = "say hello the model, café! 𝄞"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id == 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    pieces = tokenizer.convert_ids_to_tokens(
        tokenizer.encode(" the model", add_special_tokens=False)
    )
    assert pieces == ["▁the", "▁model"]
    assert "<0xC3>" in tokenizer.convert_ids_to_tokens(ids)  # é falls back to bytes
    # No chat template in the GGUF: the fallback one still renders a prompt.
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<bos>User: hi\n\nAssistant:"
    # … and the worker reports it as no chat template (a base model: not a `mesh` candidate).
    assert is_fallback_template(tokenizer.chat_template)
    assert not is_fallback_template(
        "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}"
    )


def test_gemma3_config_and_norms(tmp_path: Path) -> None:
    cfg = tiny_config("gemma3")
    weights = random_weights(cfg, seed=2)
    gguf_path = write_gguf(tmp_path / "g.gguf", cfg, weights, types=_all_f32)
    out = _convert(gguf_path, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert config["head_dim"] == cfg.head_dim == config["query_pre_attn_scalar"]
    assert config["sliding_window"] == 8
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (10000.0, 10000.0)
    saved = mx.load(str(out / "model.safetensors"))
    np.testing.assert_allclose(  # llama.cpp's +1 is taken off again
        np.array(saved["model.layers.0.pre_feedforward_layernorm.weight"]),
        weights["model.layers.0.pre_feedforward_layernorm.weight"],
        atol=1e-6,
    )


def test_wrong_magic_is_corrupt(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 100)
    with pytest.raises(CorruptGGUFError, match="not a GGUF"):
        convert_gguf(bad, tmp_path)


def test_missing_file_is_a_convert_error(tmp_path: Path) -> None:
    with pytest.raises(ConvertError, match="cannot read"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path)
    with pytest.raises(ConvertError, match="cannot read"):
        convert_gguf(tmp_path, tmp_path)  # a directory


def test_truncated_file_is_corrupt(tmp_path: Path) -> None:
    gguf_path, *_ = make_tiny_gguf(tmp_path / "m.gguf")
    data = gguf_path.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 40):
        gguf_path.write_bytes(data[:cut])
        with pytest.raises(CorruptGGUFError):
            convert_gguf(gguf_path, tmp_path)


def test_garbage_after_magic_is_corrupt(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(CorruptGGUFError):
        convert_gguf(bad, tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    writer = GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'mamba' is not supported"):
        convert_gguf(path, tmp_path)


def test_unknown_tensor_is_an_error_not_dropped(tmp_path: Path) -> None:
    cfg = tiny_config()
    weights = random_weights(cfg)
    weights["model.layers.0.self_attn.q_norm.weight"] = np.ones(cfg.head_dim, np.float32)
    gguf_path = write_gguf(tmp_path / "m.gguf", cfg, weights)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConvertError, match="attn_q_norm"):
        convert_gguf(gguf_path, out)


def test_metadata_that_contradicts_the_tensors_is_an_error(tmp_path: Path) -> None:
    cfg = tiny_config()
    weights = random_weights(cfg)
    # The header claims a wider MLP than the tensors have: the model would not load.
    gguf_path = write_gguf(tmp_path / "m.gguf", replace(cfg, intermediate=256), weights)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CorruptGGUFError, match=r"gate_proj\.weight has shape"):
        convert_gguf(gguf_path, out)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("fuzz")
    make_tiny_gguf(directory / "source.gguf")
    return directory


@settings(max_examples=60, deadline=None)
@given(fraction=st.floats(min_value=0.0, max_value=1.0, exclude_max=True))
def test_every_truncation_is_caught(fuzz_dir: Path, fraction: float) -> None:
    source = (fuzz_dir / "source.gguf").read_bytes()
    path = fuzz_dir / "cut.gguf"
    path.write_bytes(source[: int(fraction * len(source))])
    try:
        gguf = GGUFFile(path)
    except CorruptGGUFError:
        return
    # Only the alignment padding after the last tensor may be cut without losing data.
    full = GGUFFile(fuzz_dir / "source.gguf")
    for name, tensor in full.tensors.items():
        np.testing.assert_array_equal(gguf.tensors[name].data, tensor.data)


@settings(max_examples=60, deadline=None)
@given(
    fraction=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
    value=st.integers(min_value=0, max_value=255),
)
def test_corrupt_header_bytes_convert_or_fail_cleanly(
    fuzz_dir: Path, fraction: float, value: int
) -> None:
    """A changed header byte yields a loadable model or one ConvertError, nothing else."""
    source = fuzz_dir / "source.gguf"
    data = bytearray(source.read_bytes())
    data[int(fraction * GGUFReader(source).data_offset)] = value
    path = fuzz_dir / "flipped.gguf"
    path.write_bytes(bytes(data))
    out = Path(tempfile.mkdtemp(dir=fuzz_dir))
    try:
        convert_gguf(path, out, dtype=mx.float32)
    except ConvertError:
        pass
    finally:
        shutil.rmtree(out)
