"""The running rows: the jobs on mlx-lm's generator, each with its per-token state (how a
decoded token becomes its client's text: detokenizer, stop strings, loop guard, logprobs), and
:class:`Rows`, which owns the generator and those rows – it puts a job in, steps the generator,
and takes a row out with what its KV cache holds. On the engine's owner thread.

A cancelled or stopped row's cache goes to the prompt cache at once (nobody is left to wait
for): after its first token the prompt and what it generated, during its prefill the prompt
prefix of the chunks done, so a client's retry of the same prompt resumes the prefill there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from worker.engine.logprobs import token_logprob
from worker.engine.loop_guard import LoopGuard
from worker.engine.meter import Meter
from worker.engine.shared_prefill import Source
from worker.engine.types import EngineConfig, EngineStats, Job, TokenLogprob
from worker.prompt_cache.store import PromptCacheStore
from worker.sampling import StopMatcher, make_request_processors, make_request_sampler

CacheAndTokens = tuple[list[Any] | None, list[int] | None]


@dataclass(frozen=True, slots=True)
class Decoded:
    """What one generator response gives the client."""

    text: str
    logprobs: list[TokenLogprob] | None
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
    admitted_at: float = field(default_factory=time.monotonic)  # on the generator since

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
        request = self.job.request
        if request.logprobs and not is_eos:
            logprobs = [token_logprob(r.token, r.logprobs, request.top_logprobs, tokenizer)]
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


class Rows:
    """The generator and the jobs running on it, by their row's uid.

    ``make_generator`` builds a fresh generator (at start and after a failed step); the rows
    read the prompt cache (a job starts from its longest cached prefix) and keep a stopped
    row's KV in it."""

    def __init__(
        self,
        make_generator: Callable[[], Any],
        *,
        tokenizer: Any,
        eos_stops: Any,
        batchable: bool,
        config: EngineConfig,
        store: PromptCacheStore,
        meter: Meter,
        stats: EngineStats,
        on_leave: Callable[[Job], None] = lambda job: None,
    ) -> None:
        self._make_generator = make_generator
        self._on_leave = on_leave  # a row left: the memory budget takes its reservation back
        self.generator = make_generator()
        self.tokenizer = tokenizer
        self.batchable = batchable
        self._eos_stops = eos_stops
        self._config = config
        self._store = store
        self._meter = meter
        self._stats = stats
        self._active: dict[int, Active] = {}

    def __bool__(self) -> bool:
        return bool(self._active)

    def backlog(self) -> int:
        """Prompt tokens still to prefill before the rows waiting for their first token have it."""
        return sum(
            len(a.job.request.prompt) - a.held for a in self._active.values() if not a.first_token
        )

    def __iter__(self) -> Iterator[Active]:
        return iter(list(self._active.values()))

    def get(self, uid: int) -> Active | None:
        return self._active.get(uid)

    def sources(self) -> list[Source]:
        """Each row as a source of shared prefill: its prompt and what its KV holds now."""
        return [Source(uid, a.job.request.prompt, a.held) for uid, a in self._active.items()]

    # ---- in ----------------------------------------------------------------------------------

    def start(self, job: Job) -> None:
        """Put ``job`` on the generator from the longest prefix the prompt cache holds."""
        cache, cached = self._store.fetch(job.request.prompt, merged_by_reader=self.batchable)
        self.insert(job, cache, cached)

    def insert(self, job: Job, cache: list[Any] | None, cached: int, shared: bool = False) -> None:
        """Put ``job`` on the generator with ``cache`` holding its first ``cached`` prompt
        tokens (``shared``: a copy of a running sibling's KV)."""
        req = job.request
        params = req.sampling
        kwargs: dict[str, Any] = {}
        if self.batchable:
            kwargs["stop_sequences"] = [self._eos_stops]
        (uid,) = self.generator.insert(
            [req.prompt[cached:]],
            max_tokens=[req.max_tokens],
            caches=[cache],
            all_tokens=[req.prompt[:cached]],
            samplers=[make_request_sampler(params)],
            logits_processors=[make_request_processors(params) + list(req.logits_processors)],
            **kwargs,
        )
        # Not under a grammar: it ends the answer where the JSON is complete, and a cut would
        # be a "stop" whose JSON does not parse.
        span = 0 if req.logits_processors else self._config.loop_guard_tokens
        self._active[uid] = Active(
            job,
            uid,
            self.tokenizer.detokenizer,
            StopMatcher(req.stop),
            cached,
            loop=LoopGuard(span) if span else None,
            held=cached,
        )
        self._meter.prefill(len(req.prompt) - cached, cached if shared else 0)
        self._stats.log("shared_prefill" if shared else "admitted", job.id)
        if shared:
            self._stats.log("admitted", job.id)

    # ---- a step ------------------------------------------------------------------------------

    def step(self) -> list[tuple[Active, Any]]:
        """One step of the generator: each row's decoded token with its response (a row's
        first token moves it from the queue to in flight); prefill chunks done raise what a
        row's KV holds (what a follower waits for)."""
        progress, responses = self.generator.next()
        for p in progress:
            if (active := self._active.get(p.uid)) is not None:
                active.held = max(active.held, active.cached_tokens + p.progress[0])
        decoded = []
        for r in responses:
            active = self._active.get(r.uid)
            if active is None:
                continue
            if not active.first_token:
                active.first_token = True
                active.held = len(active.job.request.prompt)
                self._meter.first_token()
                computed = active.held - active.cached_tokens
                self._meter.prefilled(computed, time.monotonic() - active.admitted_at)
            decoded.append((active, r))
        if decoded:
            self._meter.decoded(len(decoded))
        return decoded

    def extract(self, uid: int) -> CacheAndTokens | None:
        """A copy of what a running row's KV holds, and its tokens."""
        found: CacheAndTokens | None = self.generator.extract_cache([uid]).get(uid)
        return found

    # ---- out ---------------------------------------------------------------------------------

    def finish(self, active: Active, r: Any, stopped: bool) -> CacheAndTokens:
        """Take a row out at its end: the generator's own (``r`` carries its cache), or a stop
        string's or the loop guard's (``stopped``), cut after the last token its client got."""
        if stopped and r.finish_reason is None:
            caches = self.generator.remove([r.uid], return_prompt_caches=True)
            cache, tokens = kept_through(active, *caches.get(r.uid, (None, None)))
        else:
            cache, tokens = r.prompt_cache, r.all_tokens
        self.drop(r.uid)
        return cache, tokens

    def stop(self, active: Active) -> CacheAndTokens:
        """Take a row out before its end; what its KV cache holds goes to the prompt cache.
        After the first token that is the prompt and the tokens so far: a client that
        interrupts and sends the conversation again (agent harnesses do) and MoA's cancelled
        losers then skip that prefill. During the prefill it is the prompt prefix of the chunks
        already done (both generators keep the token list equal to the cache after every
        chunk): a client that timed out on a long cold prefill retries from there."""
        caches = self.generator.remove([active.uid], return_prompt_caches=True)
        cache, tokens = kept_through(active, *caches.get(active.uid, (None, None)))
        self.drop(active.uid)
        # Not yet prefilling (queued in the generator): the cache is the fetched copy of an
        # entry that is still in the store; nothing new to keep.
        if cache is not None and tokens and len(tokens) > active.cached_tokens:
            self._store.insert(list(tokens), cache)
            self._stats.log("cache_kept", active.job.id)
        return cache, tokens

    def remove(self, job: Job) -> bool:
        """Take ``job``'s row out, its cache dropped; whether it had one."""
        for uid, active in list(self._active.items()):
            if active.job is job:
                self.generator.remove([uid])
                self.drop(uid)
                return True
        return False

    def drop(self, uid: int) -> None:
        """Forget a row the generator no longer runs."""
        active = self._active.pop(uid, None)
        if active is not None:
            self._meter.left(first_token=active.first_token)
            self._on_leave(active.job)

    def drop_all(self) -> list[Active]:
        """Forget every row (the generator is reset or closed next); returns them."""
        rows = list(self._active.values())
        for active in rows:
            self.drop(active.uid)
        return rows

    def reset(self) -> None:
        """A fresh generator after a failed step (the rows are dropped first). A sequential
        generator keeps no state between jobs: it stays."""
        if self.batchable:
            self.generator.close()
            self.generator = self._make_generator()

    def close(self) -> None:
        self.generator.close()
