"""Shared prefill's followers: jobs that wait for a running row's prefill and start from a fork
of its KV (worker/engine/shared_prefill.py decides when that pays).

Jobs that arrive together with one prompt (the samples of ``model="mesh"``, Chat ``n > 1``) or a
long shared prefix prefill it once: a later one waits until the first one's cache holds the shared
tokens and starts from a copy of them. Each sample stays its own job: cancelling one never stops
its siblings; a source that leaves hands its KV over to the followers it already covers and the
others are placed again. On the engine's owner thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from worker.engine.rows import Active, CacheAndTokens, Rows
from worker.engine.shared_prefill import Share, SharePolicy, plan_share
from worker.engine.types import EngineConfig, EngineStats, Job
from worker.prompt_cache.store import PromptCacheStore, copy_cache

log = logging.getLogger(__name__)


@dataclass
class Follower:
    """A job waiting for a running job's prefill to cover ``share.tokens`` of its prompt."""

    job: Job
    share: Share


class Followers:
    """The jobs waiting on a running row's prefill, and how a job is placed: after a running
    sibling (or forked from it at once), else alone on the rows.

    ``reject`` fails a job that cannot start (the engine's: it takes the job out everywhere)."""

    def __init__(
        self,
        rows: Rows,
        store: PromptCacheStore,
        config: EngineConfig,
        stats: EngineStats,
        reject: Callable[[Job, str], None],
    ) -> None:
        self._rows = rows
        self._store = store
        self._config = config
        self._stats = stats
        self._reject = reject
        self._policy = SharePolicy(min_tokens=config.share_prefill_min_tokens)
        self.waiting: list[Follower] = []

    def __bool__(self) -> bool:
        return bool(self.waiting)

    def admit(self, job: Job) -> None:
        """Start a job: from a running sibling's prefill when its prompt shares enough with one
        (worker/engine/shared_prefill.py), else from what the prompt cache holds."""
        share = self._plan_share(job.request.prompt)
        if share is None:
            self._rows.start(job)
            return
        follower = Follower(job, share)
        if not share.ready:
            self._stats.log("follows", job.id)
            self.waiting.append(follower)
            return
        source = self._rows.get(share.key)
        assert source is not None, "a ready share names a running row"
        self._fork_from(source, [follower])

    def _plan_share(self, prompt: list[int]) -> Share | None:
        if not self._config.share_prefill or not self._rows:
            return None
        cached = self._store.best_prefix(prompt)
        return plan_share(prompt, self._rows.sources(), cached=cached, policy=self._policy)

    def release(self) -> None:
        """After a step: start the followers whose source now holds their shared tokens."""
        if not self.waiting:
            return
        by_source: dict[int, list[Follower]] = {}
        for follower in self.waiting:
            by_source.setdefault(follower.share.key, []).append(follower)
        for uid, followers in by_source.items():
            source = self._rows.get(uid)
            if source is None:  # gone without handing over (failed): start them on their own
                self.waiting = [f for f in self.waiting if f not in followers]
                self.restart(followers)
            elif source.held >= min(f.share.tokens for f in followers):
                ready = [f for f in followers if source.held >= f.share.tokens]
                self.waiting = [f for f in self.waiting if f not in ready]
                self._fork_from(source, ready)

    def hand_over(self, source: Active, cache: Any, tokens: list[int] | None) -> None:
        """A source has left the generator (finished, stopped, cancelled; already dropped):
        its followers start from what its cache holds; those it does not cover yet are placed
        again (a cancelled one's partial prefill is in the store by then). A cancelled sample
        thus never takes its siblings with it."""
        followers = [f for f in self.waiting if f.share.key == source.uid]
        if not followers:
            return
        self.waiting = [f for f in self.waiting if f.share.key != source.uid]
        covered = [f for f in followers if tokens and len(tokens) >= f.share.tokens]
        if covered:
            self._fork_from(source, covered, (cache, tokens))
        self.restart([f for f in followers if f not in covered])

    def restart(self, followers: list[Follower]) -> None:
        """Place followers (out of the wait list) whose source is gone as if just submitted:
        one of them may become the others' source."""
        for follower in followers:
            self._guarded(follower.job, self.admit, follower.job)

    def cancel(self, job_id: str) -> Job | None:
        """Take a waiting job out (its client left); the job, when it was waiting."""
        waiting = [f for f in self.waiting if f.job.id == job_id]
        self.waiting = [f for f in self.waiting if f.job.id != job_id]
        return waiting[0].job if waiting else None

    def remove(self, job: Job) -> None:
        self.waiting = [f for f in self.waiting if f.job is not job]

    def take_all(self) -> list[Follower]:
        """Every waiting follower, out of the wait list."""
        waiting, self.waiting = self.waiting, []
        return waiting

    def _fork_from(
        self, source: Active, followers: list[Follower], held: CacheAndTokens | None = None
    ) -> None:
        """Start ``followers`` (already out of the wait list) from a copy of ``source``'s KV,
        each trimmed to its shared tokens. ``held``: the source's (cache, tokens) when it has
        just left the generator; else they are read from it. A follower the copy cannot serve
        (a cache that cannot be trimmed back) starts alone."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        if held is None:
            held = self._rows.extract(source.uid)
        cache, tokens = held if held is not None else (None, None)
        started = []
        for follower in followers:
            if cache is None or not tokens:
                break
            n = follower.share.tokens
            excess = len(tokens) - n
            if excess < 0 or (excess and not can_trim_prompt_cache(cache)):
                continue
            if list(tokens[:n]) != follower.job.request.prompt[:n]:
                continue
            fork = copy_cache(cache, merged_by_reader=self._rows.batchable)
            if excess:
                trim_prompt_cache(fork, excess)
            self._guarded(follower.job, self._rows.insert, follower.job, fork, n, shared=True)
            started.append(follower)
        for follower in followers:
            if follower not in started:
                self._guarded(follower.job, self._rows.start, follower.job)

    def _guarded(self, job: Job, start: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """Start a waiting job; one that cannot start fails alone (as a bad submit does), not
        the step that released it."""
        try:
            start(*args, **kwargs)
        except Exception as exc:
            log.exception("cannot start job %s", job.id)
            self._reject(job, f"cannot start generation: {exc}")
