"""A running job on the engine's owner thread: its per-token state, and how a decoded token
becomes its client's text (detokenizer, stop strings, loop guard, logprobs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.engine.loop_guard import LoopGuard
from worker.engine.types import Job
from worker.sampling import StopMatcher


@dataclass(frozen=True, slots=True)
class Decoded:
    """What one generator response gives the client."""

    text: str
    logprobs: list[tuple[str, float]] | None
    finish: str | None  # None: the job goes on
    stopped: bool  # a stop string (or the loop guard) ended it, not the generator
    looped: bool  # the loop guard ended it


@dataclass
class Active:
    job: Job
    uid: int
    detokenizer: Any
    stop: StopMatcher
    cached_tokens: int  # of the prompt, from the prompt cache or a sibling's prefill
    held: int = 0  # prompt tokens its KV cache holds now (grows chunk by chunk while prefilling)
    completion_tokens: int = 0
    first_token: bool = False
    loop: LoopGuard | None = None  # None: the loop guard is off

    def decode(self, r: Any, tokenizer: Any) -> Decoded:
        """Feed the generator's response ``r`` (a token, maybe a finish reason) through the
        detokenizer, the stop strings and the loop guard."""
        self.completion_tokens += 1
        detok = self.detokenizer
        is_eos = r.finish_reason == "stop"
        if not is_eos:
            detok.add_token(r.token)
        if r.finish_reason is not None:
            detok.finalize()
        text, stopped = self.stop.feed(detok.last_segment)
        looped = not stopped and r.finish_reason is None and self._looping(r.token)
        if looped:
            text, stopped = text + self.stop.flush(), True  # ends as if the model had stopped
        finish = r.finish_reason
        if stopped:
            finish = "stop"
        elif finish is not None:
            text += self.stop.flush()
        logprobs = None
        if self.job.request.logprobs and not is_eos:
            logprob = r.logprobs[r.token].item()
            logprobs = [(tokenizer.decode([r.token]), logprob)]
        return Decoded(text, logprobs, finish, stopped, looped)

    def _looping(self, token: int) -> bool:
        return self.loop is not None and self.loop.feed(token)


def kept_through(
    active: Active, cache: list[Any] | None, tokens: list[int] | None
) -> tuple[list[Any] | None, list[int] | None]:
    """A job's KV cache and tokens cut after the last token its client was given.

    A speculative step (worker/speculative/batch.py) puts several tokens in the cache at once; when
    a stop string or the loop guard ends the answer at one of them, or the client leaves, the
    tokens after it were never part of the answer and their KV must not reach the prompt cache.
    Without speculation the cut is a no-op."""
    if cache is None or tokens is None or not active.first_token:
        return cache, tokens
    keep = len(active.job.request.prompt) + active.completion_tokens
    excess = len(tokens) - keep
    if excess <= 0:
        return cache, tokens
    from mlx_lm.models.cache import trim_prompt_cache

    trim_prompt_cache(cache, excess)
    return cache, list(tokens[:keep])
