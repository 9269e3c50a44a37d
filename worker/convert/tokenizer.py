"""Build Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json) from GGUF metadata.

Two vocabularies occur in GGUF files:
- ``gpt2``: byte-level BPE with an explicit merge list (SmolLM, Llama 3, Qwen…);
- ``llama``: SentencePiece pieces with scores and ``<0xNN>`` byte-fallback pieces (Llama 2, Gemma).
  SentencePiece BPE merges the pair whose result scores highest, so merges are rebuilt from the
  scores the same way transformers converts a SentencePiece model.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre

from worker.convert.errors import CorruptGGUFError, UnsupportedModelError
from worker.convert.gguf_file import GGUFFile

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Fallback for models without a chat template (base models): plain role-prefixed turns.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def is_fallback_template(template: object) -> bool:
    """Whether ``template`` is the one :func:`build_tokenizer` writes when the GGUF has none (a
    base model's, gemma3-270m's): it renders a prompt, but the model was not trained on turns."""
    return isinstance(template, str) and template.removeprefix("{{ bos_token }}") == (
        FALLBACK_CHAT_TEMPLATE
    )


def _fallback_template(add_bos: bool) -> str:
    # Chat templates are encoded without special tokens, so the template itself starts with the
    # BOS a model expects (base Gemma degrades badly without it).
    return ("{{ bos_token }}" if add_bos else "") + FALLBACK_CHAT_TEMPLATE


def _byte_level_pre_tokenizer(pre_type: str) -> pre.PreTokenizer:
    """The split rules llama.cpp names in ``tokenizer.ggml.pre`` (unknown: plain GPT-2)."""
    byte_level = pre.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre_type in ("llama-bpe", "llama3", "dbrx", "smaug-bpe", "falcon3"):
        split = pre.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False)
        return pre.Sequence([split, byte_level])
    if pre_type in ("qwen2", "deepseek-r1-qwen"):
        split = pre.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False)
        return pre.Sequence([split, byte_level])
    gpt2 = pre.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_type in ("smollm", "starcoder", "refact", "codeshell"):
        return pre.Sequence([pre.Digits(individual_digits=True), gpt2])
    return gpt2


def _make_tokenizer(model: type, **kwargs: Any) -> Tokenizer:
    try:
        return Tokenizer(model(**kwargs))
    except Exception as exc:  # tokenizers raises bare Exception for an inconsistent vocabulary
        raise CorruptGGUFError(f"the tokenizer vocabulary is inconsistent: {exc}") from exc


def _byte_level_bpe(gguf: GGUFFile, tokens: list[str]) -> Tokenizer:
    merges_raw = gguf.get("tokenizer.ggml.merges")
    if not merges_raw:
        raise UnsupportedModelError("gpt2 tokenizer without merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = []
    for merge in merges_raw:
        left, sep, right = str(merge).partition(" ")
        if not sep or left not in vocab or right not in vocab or left + right not in vocab:
            raise CorruptGGUFError(f"merge {merge!r} does not fit the vocabulary")
        merges.append((left, right))
    tok = _make_tokenizer(models.BPE, vocab=vocab, merges=merges, fuse_unk=False)
    tok.pre_tokenizer = _byte_level_pre_tokenizer(str(gguf.get("tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(gguf: GGUFFile, tokens: list[str], types: list[int]) -> Tokenizer:
    scores = gguf.get("tokenizer.ggml.scores")
    if not scores:
        raise UnsupportedModelError("SentencePiece tokenizer without scores")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    mergeable = {tok for tok, t in zip(tokens, types, strict=True) if t in (NORMAL, USER_DEFINED)}
    ranked = []
    for piece in mergeable:
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[vocab[piece]], vocab[left], vocab[right], left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]
    unk_id = gguf.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = _make_tokenizer(
        models.BPE, vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True
    )
    add_prefix = bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if add_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    out = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        out.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(out)
    return tok


_ID_KEYS = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}


def _token(gguf: GGUFFile, tokens: list[str], key: str) -> str | None:
    idx = gguf.get(f"tokenizer.ggml.{_ID_KEYS[key]}_token_id")
    if idx is None or not 0 <= int(idx) < len(tokens):
        return None
    return tokens[int(idx)]


def build_tokenizer(gguf: GGUFFile) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer and the ``tokenizer_config.json`` contents for a GGUF's vocabulary."""
    tokens = [str(t) for t in gguf.get("tokenizer.ggml.tokens") or []]
    if not tokens:
        raise UnsupportedModelError("the GGUF has no tokenizer vocabulary")
    types = [int(t) for t in gguf.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)]
    kind = gguf.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok = _byte_level_bpe(gguf, tokens)
    elif kind == "llama":
        tok = _sentencepiece_bpe(gguf, tokens, types)
    else:
        raise UnsupportedModelError(f"tokenizer model {kind!r} is not supported")

    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty in (CONTROL, UNKNOWN)
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == USER_DEFINED
        ]
    )

    bos = _token(gguf, tokens, "bos")
    add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    if add_bos and bos is not None:
        bos_id = int(gguf.require("tokenizer.ggml.bos_token_id"))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": bool(gguf.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(gguf.get(f"{gguf.architecture}.context_length", 4096)),
        "chat_template": gguf.get("tokenizer.chat_template") or _fallback_template(add_bos),
    }
    for key in ("bos", "eos", "unk", "pad"):
        value = _token(gguf, tokens, key)
        if value is not None:
            config[f"{key}_token"] = value
    return tok, config
