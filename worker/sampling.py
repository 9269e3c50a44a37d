"""Per-request sampling: parameters, a seeded sampler, logits processors and stop strings.

Each request owns its sampler (and, when seeded, its own PRNG key), so requests batched together
never share random state: the same seed gives the same tokens whatever else is running.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p, make_logits_processors

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


@mx.compile
def _apply_min_p(logprobs: mx.array, log_min_p: mx.array) -> mx.array:
    """mlx-lm's ``apply_min_p`` (one token kept at least), the threshold an input array."""
    top = mx.max(logprobs, axis=-1, keepdims=True)
    return mx.where(logprobs < top + log_min_p.astype(logprobs.dtype), -mx.inf, logprobs)


def make_request_sampler(params: SamplingParams) -> Sampler:
    """A sampler for one request; seeded samplers draw from their own key chain."""
    if params.temperature <= 0:
        return greedy
    return RequestSampler(params)


class RequestSampler:
    """Samples one request's tokens at temperature > 0: its filters (top-p, min-p, top-k), then
    the temperature. A seeded sampler draws the n-th token of its answer with the n-th key of
    its chain, however it is asked: a plain step draws one (``__call__``), a verify pass draws
    one for each of its positions and keeps the keys of those it used (:meth:`draw_each`,
    :meth:`keep`), so speculation gives a seed the same tokens as plain decoding."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._filters: list[Callable[[mx.array], mx.array]] = []
        # Thresholds go in as arrays: mx.compile bakes a float argument into the kernel it
        # builds, so each new top_p or min_p value cost the request that first used it a kernel
        # compile (~1 s on the CPU backend); as inputs, one kernel serves every value (the
        # warm-up builds it).
        if 0 < params.top_p < 1.0:
            top_p = mx.array(params.top_p, dtype=mx.float32)
            self._filters.append(lambda x: apply_top_p(x, top_p))
        if params.min_p > 0:
            log_min_p = mx.array(math.log(params.min_p), dtype=mx.float32)
            self._filters.append(lambda x: _apply_min_p(x, log_min_p))
        if params.top_k > 0:
            self._filters.append(lambda x: apply_top_k(x, params.top_k))
        self._inverse_temperature = 1.0 / params.temperature
        # Keys take unsigned 64-bit seeds; a negative (signed) one maps to its two's complement.
        self._key = None if params.seed is None else mx.random.key(params.seed % 2**64)
        self._drawn: list[mx.array] = []  # the chain after each of draw_each's positions

    def _next_key(self) -> mx.array | None:
        if self._key is None:
            return None
        self._key, step_key = mx.random.split(self._key)
        return step_key

    def scaled(self, logprobs: mx.array) -> mx.array:
        """The logits the token is drawn from: filtered, divided by the temperature."""
        for apply in self._filters:
            logprobs = apply(logprobs)
        return logprobs * self._inverse_temperature

    def probs(self, logprobs: mx.array) -> mx.array:
        return mx.softmax(self.scaled(logprobs), axis=-1)

    def __call__(self, logprobs: mx.array) -> mx.array:
        return mx.random.categorical(self.scaled(logprobs), key=self._next_key())

    def draw_each(self, logprobs: mx.array) -> list[int]:
        """A token for each position of ``logprobs`` (positions x vocabulary), each with the
        key the plain step at that position would use; the chain stays where it was until
        :meth:`keep` says how many of them the answer took."""
        scaled = self.scaled(logprobs)
        key, draws, self._drawn = self._key, [], []
        for j in range(scaled.shape[0]):
            step_key = None
            if key is not None:
                key, step_key = mx.random.split(key)
                self._drawn.append(key)
            # One row at a time, shaped as a plain step's: the same key draws the same token.
            draws.append(mx.random.categorical(scaled[j : j + 1], key=step_key))
        return [int(t) for t in mx.concatenate(draws).tolist()]

    def keep(self, used: int) -> None:
        """The answer took the first ``used`` tokens :meth:`draw_each` drew."""
        if used and self._drawn:
            self._key = self._drawn[used - 1]
        self._drawn = []


@runtime_checkable
class DraftAwareProcessor(Protocol):
    """A logits processor that speculative decoding may run on drafted positions
    (worker/speculative/batch.py): a verify pass calls it once a position, in order, each time with
    the context one token longer (as plain decoding would, had the drafts been sampled), then
    gives back the tokens the model did not accept."""

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array: ...

    def draft_limit(self, unseen: list[int], draft: list[int]) -> int:
        """How many of ``draft`` may be checked after ``unseen`` (the context's tokens this
        processor has not been called with: the token just sampled)."""
        ...

    def rollback(self, count: int) -> None:
        """Forget the last ``count`` tokens it was called with (drafts the model refused)."""
        ...


class ContextProcessor:
    """One of mlx-lm's processors (logit bias, repetition/presence/frequency penalties): a
    function of the context alone, so any drafted position is processed right by handing it
    its own context, and nothing needs giving back."""

    def __init__(self, function: LogitsProcessor) -> None:
        self.function = function

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        return self.function(tokens, logits)

    def draft_limit(self, unseen: list[int], draft: list[int]) -> int:
        return len(draft)

    def rollback(self, count: int) -> None:
        pass


def make_request_processors(params: SamplingParams) -> list[LogitsProcessor]:
    processors = make_logits_processors(
        logit_bias=params.logit_bias or None,
        repetition_penalty=params.repetition_penalty or None,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
    )
    return [ContextProcessor(p) for p in processors]


class StopMatcher:
    """Finds stop strings in streamed text, even when split across tokens.

    ``feed`` returns the text that is safe to emit and whether a stop string completed; text that
    might be the start of a stop string is held back. The stop string itself is never emitted;
    ``matched`` says which one it was (clients report it, e.g. Anthropic's ``stop_sequence``).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        if not self._stops:
            return text, False
        buffer = self._held + text
        hits = [(i, stop) for stop in self._stops if (i := buffer.find(stop)) >= 0]
        if hits:
            # The earliest match wins; at a tie the longer stop, which contains the other.
            at, self.matched = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
            self._held = ""
            return buffer[:at], True
        keep = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buffer)), keep, -1):
                if buffer.endswith(stop[:n]):
                    keep = n
                    break
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """The held-back text, at the end of generation (no stop string came)."""
        held, self._held = self._held, ""
        return held
