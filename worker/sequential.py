"""A one-at-a-time generator with the slice of ``BatchGenerator``'s interface the engine uses.

For models whose KV cache cannot be merged into a batch (``merge`` missing): requests are served
in arrival order, one decode step per ``next()`` call, so the engine stays responsive (cancel,
new submissions) between tokens exactly as with batching.
"""

from __future__ import annotations

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
class _Sequence:
    uid: int
    prompt: list[int]
    max_tokens: int
    cache: list[Any]
    tokens: list[int]  # what the cache holds (once running)
    sampler: Any
    processors: list[Any]
    eos: set[int]
    steps: Iterator[tuple[int, mx.array]] | None = None
    produced: int = 0


class SequentialGenerator:
    def __init__(self, model: Any, *, eos_token_ids: set[int], stream: Any = None) -> None:
        self._model = model
        self._eos = set(eos_token_ids)
        self._stream = stream
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

    def next(self) -> tuple[list[Any], list[SequentialResponse]]:
        if self._current is None:
            if not self._queue:
                return [], []
            seq = self._queue.popleft()
            kwargs = {"stream": self._stream} if self._stream is not None else {}
            seq.steps = generate_step(
                mx.array(seq.prompt),
                self._model,
                max_tokens=seq.max_tokens,
                sampler=seq.sampler,
                logits_processors=seq.processors or None,
                prompt_cache=seq.cache,
                **kwargs,
            )
            seq.tokens.extend(seq.prompt)
            self._current = seq
        seq = self._current
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

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> dict[int, Any]:
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
