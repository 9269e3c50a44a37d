"""The grammar logits processor on the tiny model's tokenizer, driven by random logits: whatever
the model would say, the text is JSON that validates, and it may end only where the value does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.utils import load_tokenizer

from worker.structured.json_grammar import json_grammar
from worker.structured.processor import grammar_tokenizer, make_grammar_processor

WORD = {"type": "string", "maxLength": 6}
PERSON = {
    "type": "object",
    "properties": {
        "name": WORD,
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": WORD, "maxItems": 2},
        "home": {
            "type": "object",
            "properties": {"city": WORD, "zip": {"type": "string", "pattern": "^[0-9]{3}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "kind", "tags", "home"],
    "additionalProperties": False,
}
EITHER = {"anyOf": [{"type": "boolean"}, {"type": "array", "items": {"const": 1}, "maxItems": 3}]}
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def _decode(tokenizer: Any, schema: dict[str, Any], seed: int, width: int | None = None) -> str:
    """Sample from random logits through the processor until an end token; checks at each step
    that an end token is allowed exactly when the grammar is complete."""
    rng = np.random.default_rng(seed)
    processor = make_grammar_processor(tokenizer, json_grammar(schema))
    width = width or len(tokenizer._tokenizer)
    eos = sorted(tokenizer.eos_token_ids)
    tokens = list(PROMPT)
    for _ in range(400):
        logits = mx.array(rng.normal(scale=3.0, size=(1, width)).astype(np.float32))
        masked = np.array(processor(mx.array(tokens), logits)[0])
        allowed = np.isfinite(masked)
        assert allowed.any()
        assert bool(allowed[eos].any()) == processor.matcher.is_accepting()
        p = np.exp(masked - masked[allowed].max())
        token = int(rng.choice(width, p=p / p.sum()))
        if token in eos:
            return tokenizer.decode(tokens[len(PROMPT) :])
        tokens.append(token)
    raise AssertionError("no end token in 400 steps")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), schema=st.sampled_from([PERSON, EITHER]))
def test_random_logits_give_valid_json(tokenizer: Any, seed: int, schema: dict[str, Any]) -> None:
    jsonschema.validate(json.loads(_decode(tokenizer, schema, seed)), schema)


def test_a_padded_vocabulary_never_samples_past_the_tokenizer(tokenizer: Any) -> None:
    vocab = len(tokenizer._tokenizer)
    processor = make_grammar_processor(tokenizer, json_grammar(PERSON))
    masked = np.array(processor(mx.array(PROMPT), mx.zeros((1, vocab + 64)))[0])
    assert np.isneginf(masked[vocab:]).all() and np.isfinite(masked[:vocab]).any()
    text = _decode(tokenizer, PERSON, seed=1, width=vocab + 64)
    jsonschema.validate(json.loads(text), PERSON)


def test_after_the_end_token_only_end_tokens_are_allowed(tokenizer: Any) -> None:
    """mlx-lm computes one step past the end token (its result is dropped): it must not fail."""
    processor = make_grammar_processor(tokenizer, json_grammar({"const": True}))
    tokens = list(PROMPT)
    for _ in range(10):
        masked = np.array(processor(mx.array(tokens), mx.zeros((1, len(tokenizer._tokenizer))))[0])
        tokens.append(int(np.flatnonzero(np.isfinite(masked))[0]))
        if tokens[-1] in tokenizer.eos_token_ids:
            break
    assert tokenizer.decode(tokens[len(PROMPT) : -1]) == "true"
    masked = np.array(processor(mx.array(tokens), mx.zeros((1, len(tokenizer._tokenizer))))[0])
    assert set(np.flatnonzero(np.isfinite(masked))) == set(tokenizer.eos_token_ids)


def test_the_grammar_tokenizer_is_built_once_per_model_tokenizer(tokenizer: Any) -> None:
    assert grammar_tokenizer(tokenizer) is grammar_tokenizer(tokenizer)
    assert grammar_tokenizer(tokenizer).eos_tokens == sorted(tokenizer.eos_token_ids)


class PanicException(BaseException):
    """What pyo3 raises for a Rust panic (matched by name: pyo3_runtime is not importable)."""


class _PanickingMatcher:
    def consume_tokens(self, tokens: list[int]) -> bool:
        raise PanicException("index out of bounds")


def test_a_panic_mid_answer_ends_it_instead_of_the_engine_thread(tokenizer: Any) -> None:
    processor = make_grammar_processor(tokenizer, json_grammar(PERSON))
    width = len(tokenizer._tokenizer)
    processor(mx.array(PROMPT), mx.zeros((1, width)))
    processor.matcher = _PanickingMatcher()  # type: ignore[assignment]
    for step in range(2):
        masked = np.array(processor(mx.array([*PROMPT, 9, step]), mx.zeros((1, width)))[0])
        assert set(np.flatnonzero(np.isfinite(masked))) == set(tokenizer.eos_token_ids)
