"""A one-at-a-time generator with the slice of ``BatchGenerator``'s interface the engine uses.

For models whose KV cache cannot be merged into a batch (``merge`` missing): requests are served
in arrival order, one step per ``next()`` call, so the engine stays responsive (cancel, new
submissions) between steps exactly as with batching. A step is one decoded token or, before the
first token, one prefill chunk of ``prefill_step_size`` prompt tokens (as ``BatchGenerator``
does): a long prompt whose client is gone stops within one chunk, and ``remove`` hands back the
KV of the chunks already done.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache


@dataclass
class SequentialResponse:
    uid: int
    token: int
    logprobs: mx.array
    finish_reason: str | None
    prompt_cache: list[Any] | None
    all_tokens: list[int] | None


@dataclass
class SequentialProgress:
    """A prefill chunk done, like ``BatchGenerator``'s prompt responses: ``progress[0]`` of the
    ``progress[1]`` prompt tokens inserted (those not in the cache) are in the cache now."""

    uid: int
    progress: tuple[int, int]


@dataclass
class _Sequence:
    uid: int
    prompt: list[int]  # the prompt tokens not in the cache when inserted
    max_tokens: int
    cache: list[Any]
    tokens: list[int]  # exactly what the cache holds, at every step
    sampler: Any
    processors: list[Any]
    eos: set[int]
    fed: int = 0  # prompt tokens prefilled into the cache so far
    steps: Iterator[tuple[int, mx.array]] | None = None
    produced: int = 0


class SequentialGenerator:
    def __init__(
        self,
        model: Any,
        *,
        eos_token_ids: set[int],
        stream: Any = None,
        prefill_step_size: int = 512,
    ) -> None:
        self._model = model
        self._eos = set(eos_token_ids)
        self._stream = stream if stream is not None else mx.default_stream(mx.default_device())
        self._prefill_step_size = prefill_step_size
        self._queue: deque[_Sequence] = deque()
        self._current: _Sequence | None = None
        self._uid = 0

    def insert(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        caches: list[list[Any] | None],
        all_tokens: list[list[int]],
        samplers: list[Any],
        logits_processors: list[list[Any]],
    ) -> list[int]:
        uids = []
        for prompt, limit, cache, held, sampler, processors in zip(
            prompts, max_tokens, caches, all_tokens, samplers, logits_processors, strict=True
        ):
            cache = cache if cache is not None else make_prompt_cache(self._model)
            seq = _Sequence(
                self._uid, list(prompt), limit, cache, list(held), sampler, processors, self._eos
            )
            self._queue.append(seq)
            uids.append(self._uid)
            self._uid += 1
        return uids

    def next(self) -> tuple[list[SequentialProgress], list[SequentialResponse]]:
        if self._current is None:
            if not self._queue:
                return [], []
            self._current = self._queue.popleft()
        seq = self._current
        if seq.steps is None:
            # Like generate_step: every prompt token but the last goes in by chunks; the last
            # one starts decoding.
            if len(seq.prompt) - seq.fed > 1:
                self._prefill_chunk(seq)
                return [SequentialProgress(seq.uid, (seq.fed, len(seq.prompt)))], []
            self._start_decoding(seq)
        assert seq.steps is not None
        token, logprobs = next(seq.steps)
        # generate_step runs one step ahead: the cache already holds this token.
        seq.tokens.append(token)
        seq.produced += 1
        finish = None
        if token in seq.eos:
            finish = "stop"
        elif seq.produced >= seq.max_tokens:
            finish = "length"
        if finish is None:
            return [], [SequentialResponse(seq.uid, token, logprobs, None, None, None)]
        self._current = None
        return [], [SequentialResponse(seq.uid, token, logprobs, finish, seq.cache, seq.tokens)]

    def _prefill_chunk(self, seq: _Sequence) -> None:
        n = min(self._prefill_step_size, len(seq.prompt) - seq.fed - 1)
        chunk = seq.prompt[seq.fed : seq.fed + n]
        prefill_into(self._model, chunk, seq.cache, self._stream)
        seq.fed += n
        seq.tokens.extend(chunk)

    def _start_decoding(self, seq: _Sequence) -> None:
        rest = seq.prompt[seq.fed :]
        seq.steps = generate_step(
            mx.array(rest),
            self._model,
            max_tokens=seq.max_tokens,
            sampler=seq.sampler,
            logits_processors=_with_context(seq.processors, seq.tokens),
            prompt_cache=seq.cache,
            stream=self._stream,
        )
        seq.tokens.extend(rest)

    def extract_cache(self, uids: list[int]) -> dict[int, Any]:
        """(a copy of the cache, the tokens it holds) of the running sequence, if it is one of
        ``uids``; a queued one has computed nothing yet."""
        found: dict[int, Any] = {}
        seq = self._current
        if seq is not None and seq.uid in uids:
            found[seq.uid] = (copy.deepcopy(seq.cache), list(seq.tokens))
        return found

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> dict[int, Any]:
        """Drop sequences; with ``return_prompt_caches`` the running one's (cache, tokens), the
        tokens being exactly what the cache holds (a prefix of the prompt while prefilling)."""
        found: dict[int, Any] = {}
        wanted = set(uids)
        if self._current is not None and self._current.uid in wanted:
            found[self._current.uid] = (self._current.cache, self._current.tokens)
            self._current = None
        self._queue = deque(s for s in self._queue if s.uid not in wanted)
        return found if return_prompt_caches else {}

    def close(self) -> None:
        self._queue.clear()
        self._current = None


def prefill_into(model: Any, tokens: list[int], cache: list[Any], stream: Any = None) -> None:
    """Run ``tokens`` through ``model`` onto ``cache`` (evaluated), then hand MLX's buffer cache
    back: a prefill chunk outside mlx-lm's generators (this one's, an answer's next turn)."""
    with mx.stream(stream if stream is not None else mx.default_stream(mx.default_device())):
        model(mx.array(tokens)[None], cache=cache)
        mx.eval([c.state for c in cache])
    mx.clear_cache()


def _with_context(processors: list[Any], held: list[int]) -> list[Any] | None:
    """The processors, seeing the tokens already in the cache before the ones generate_step
    tracks (it only knows the prompt tokens it was given), as ``BatchGenerator``'s do."""
    if not processors:
        return None
    if not held:
        return processors
    head = mx.array(held)

    def wrap(processor: Any) -> Any:
        return lambda tokens, logits: processor(mx.concatenate([head, tokens]), logits)

    return [wrap(p) for p in processors]
