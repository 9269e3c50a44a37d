"""Constrained decoding: an mlx-lm logits processor that holds one request to an llguidance grammar.

Each request with a schema gets its own ``GrammarProcessor`` (its own ``LLMatcher``) in its list of
logits processors, so batched requests never share matcher state and a request without a schema
runs no code of this module. At every step the processor consumes the token sampled last (the
newest one in the context mlx-lm passes) and masks the logits to what the grammar allows next.
The end-of-sequence tokens are allowed only where the grammar is complete, so the answer ends
exactly when the JSON value does; ``max_tokens`` before that ends it as ``length`` (incomplete).

The llguidance tokenizer is built once per model tokenizer (about 0.5 s for a 49k vocabulary) and
matchers are created before the job is submitted (``make_grammar_processor``, off the event loop):
the engine's owner thread never waits for either.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np

from worker.structured.json_grammar import SchemaError, is_panic

log = logging.getLogger(__name__)

_tokenizers: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def grammar_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """The llguidance tokenizer for mlx-lm's ``TokenizerWrapper`` (built once, then cached); its
    end tokens are the model's (``eos_token_ids``: a chat model's end-of-turn token included)."""
    with _tokenizers_lock:
        found = _tokenizers.get(tokenizer)
        if found is None:
            found = llguidance.hf.from_tokenizer(
                tokenizer._tokenizer, eos_token=sorted(tokenizer.eos_token_ids)
            )
            _tokenizers[tokenizer] = found
        return found


def special_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` when the model writes it as one special token: a grammar must name
    such a token (``<[id]>``), llguidance never matches it by its text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and grammar_tokenizer(tokenizer).is_special_token(ids[0]):
        return int(ids[0])
    return None


class GrammarUnavailable(Exception):
    """This model's tokenizer cannot be read by llguidance (not a fast HF tokenizer)."""


def make_grammar_processor(tokenizer: Any, grammar: str) -> GrammarProcessor:
    """A fresh processor for one request; SchemaError when the grammar does not compile for
    this model's vocabulary, GrammarUnavailable when the model's tokenizer cannot be used.
    Blocks (compiling can take up to ~1 s): call it off the loop."""
    try:
        lltok = grammar_tokenizer(tokenizer)
    except (ValueError, TypeError, AttributeError) as exc:
        raise GrammarUnavailable(
            f"this model's tokenizer cannot hold an answer to a grammar: {exc}"
        ) from exc
    try:
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    except BaseException as exc:
        if not is_panic(exc):
            raise
        raise SchemaError(f"the grammar library failed on this schema: {exc}") from None
    if matcher.is_error():
        raise SchemaError(" ".join(matcher.get_error().split()))
    return GrammarProcessor(matcher, lltok.vocab_size, sorted(tokenizer.eos_token_ids))


class GrammarProcessor:
    """``processor(tokens, logits) -> logits`` for mlx-lm (``BatchGenerator`` and
    ``generate_step`` alike): ``tokens`` is the whole context, the prompt first."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos: list[int]) -> None:
        self.matcher = matcher
        self._vocab_size = vocab_size
        self._eos = eos
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
        self._seen: int | None = None  # context length already consumed (the prompt at first)
        self._broken = False

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        try:
            allowed = self._step(tokens, logits.shape[-1])
        except BaseException as exc:
            # A panic would pass the engine's ``except Exception`` and end its owner thread.
            if not is_panic(exc):
                raise
            log.error("the grammar library failed mid-answer: %s", exc)
            self._broken = True
            allowed = self._only_end(logits.shape[-1])
        return mx.where(allowed, logits, -mx.inf)

    def _step(self, tokens: mx.array, width: int) -> mx.array:
        if self._seen is None:
            self._seen = tokens.size
        elif tokens.size > self._seen:
            # Through numpy: a slice of the mx array would be one more graph to evaluate.
            new = np.asarray(tokens)[self._seen :].tolist()
            self._seen = tokens.size
            if not self.matcher.consume_tokens(new) and not self.matcher.is_stopped():
                log.warning("grammar rejected a sampled token: %s", self.matcher.get_error())
        if self._broken or self.matcher.is_stopped() or self.matcher.is_error():
            # Done (the end token was sampled: this step is discarded) or broken: end it.
            return self._only_end(width)
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self._bitmask)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        bits[self._vocab_size :] = 0  # the last word's spare bits
        if bits.size < width:  # the model's output is padded past the tokenizer's vocabulary
            bits = np.pad(bits, (0, width - bits.size))
        return mx.array(bits[:width].view(np.bool_))

    # Speculative decoding (worker.sampling.DraftAwareProcessor): the verify pass calls this
    # processor on each drafted position in turn, so the matcher consumes the drafts, and
    # gives back the ones the model refused.
    def draft_limit(self, unseen: list[int], draft: list[int]) -> int:
        """How many of ``draft`` the grammar allows after ``unseen``; a draft stops before an
        end token (the answer ends there anyway: drafting past it gains nothing)."""
        if self._broken or self.matcher.is_stopped() or self.matcher.is_error():
            return 0
        for at, token in enumerate(draft):
            if token in self._eos:
                draft = draft[:at]
                break
        try:
            valid = self.matcher.validate_tokens(unseen + draft)
        except BaseException as exc:  # a panic would end the engine's owner thread
            if not is_panic(exc):
                raise
            log.error("the grammar library failed checking a draft: %s", exc)
            return 0
        return max(0, valid - len(unseen))

    def rollback(self, count: int) -> None:
        if count <= 0 or self._broken or self._seen is None:
            return
        try:
            given_back = self.matcher.rollback(count)
        except BaseException as exc:
            if not is_panic(exc):
                raise
            given_back = False
        if not given_back:
            # The answer is then ended at the next step (only end tokens allowed).
            log.error("the grammar could not give back %d drafted tokens", count)
            self._broken = True
        self._seen -= count

    def _only_end(self, width: int) -> mx.array:
        allowed = np.zeros(width, dtype=np.bool_)
        allowed[[t for t in self._eos if t < width]] = True
        return mx.array(allowed)
