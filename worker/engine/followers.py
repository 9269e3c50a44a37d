"""The engine's shared prefill: jobs that follow a running job's prefill and start from a fork
of its KV (worker/engine/shared_prefill.py decides when that pays).

Jobs that arrive together with one prompt (the samples of ``model="mesh"``, Chat ``n > 1``) or a
long shared prefix prefill it once: a later one waits until the first one's cache holds the shared
tokens and starts from a copy of them. Each sample stays its own job: cancelling one never stops
its siblings; a source that leaves hands its KV over to the followers it already covers and the
others are placed again.

A mixin of :class:`worker.engine.core.Engine`: it runs on the owner thread, on the engine's running
jobs and generator, and starts jobs through the engine's ``_insert`` and ``_start_alone``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from worker.engine.jobs import Active
from worker.engine.shared_prefill import Share, SharePolicy, Source, plan_share
from worker.engine.types import EngineConfig, EngineStats, Job
from worker.prompt_cache.store import PromptCacheStore, copy_cache


@dataclass
class Follower:
    """A job waiting for a running job's prefill to cover ``share.tokens`` of its prompt."""

    job: Job
    share: Share


class SharedPrefill:
    """Followers and forks; the engine's state it works on is declared here."""

    config: EngineConfig
    stats: EngineStats
    batchable: bool
    _generator: Any
    _active: dict[int, Active]
    _store: PromptCacheStore
    _followers: list[Follower]
    _share_policy: SharePolicy

    if TYPE_CHECKING:

        def _insert(
            self, job: Job, cache: list[Any] | None, cached: int, shared: bool = False
        ) -> None: ...

        def _start_alone(self, job: Job) -> None: ...

        def _guarded(
            self, job: Job, start: Callable[..., None], *args: Any, **kwargs: Any
        ) -> None: ...

    def _admit(self, job: Job) -> None:
        """Start a job: from a running sibling's prefill when its prompt shares enough with one
        (worker/engine/shared_prefill.py), else from what the prompt cache holds."""
        share = self._plan_share(job.request.prompt)
        if share is not None:
            follower = Follower(job, share)
            if not share.ready:
                self.stats.log("follows", job.id)
                self._followers.append(follower)
                return
            self._fork_from(self._active[share.key], [follower])
            return
        self._start_alone(job)

    def _plan_share(self, prompt: list[int]) -> Share | None:
        if not self.config.share_prefill or not self._active:
            return None
        sources = [Source(uid, a.job.request.prompt, a.held) for uid, a in self._active.items()]
        cached = self._store.best_prefix(prompt)
        return plan_share(prompt, sources, cached=cached, policy=self._share_policy)

    def _release_followers(self) -> None:
        """After a step: start the followers whose source now holds their shared tokens."""
        if not self._followers:
            return
        by_source: dict[int, list[Follower]] = {}
        for follower in self._followers:
            by_source.setdefault(follower.share.key, []).append(follower)
        for uid, followers in by_source.items():
            source = self._active.get(uid)
            if source is None:  # gone without handing over (failed): start them on their own
                self._followers = [f for f in self._followers if f not in followers]
                self._restart_followers(followers)
            elif source.held >= min(f.share.tokens for f in followers):
                ready = [f for f in followers if source.held >= f.share.tokens]
                self._followers = [f for f in self._followers if f not in ready]
                self._fork_from(source, ready)

    def _fork_from(
        self,
        source: Active,
        followers: list[Follower],
        held: tuple[list[Any] | None, list[int] | None] | None = None,
    ) -> None:
        """Start ``followers`` (already out of the wait list) from a copy of ``source``'s KV,
        each trimmed to its shared tokens. ``held``: the source's (cache, tokens) when it has
        just left the generator; else they are read from it. A follower the copy cannot serve
        (a cache that cannot be trimmed back) starts alone."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        if held is None:
            held = self._generator.extract_cache([source.uid]).get(source.uid)
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
            fork = copy_cache(cache, merged_by_reader=self.batchable)
            if excess:
                trim_prompt_cache(fork, excess)
            self._guarded(follower.job, self._insert, follower.job, fork, n, shared=True)
            started.append(follower)
        for follower in followers:
            if follower not in started:
                self._guarded(follower.job, self._start_alone, follower.job)

    def _restart_followers(self, followers: list[Follower]) -> None:
        """Place followers (out of the wait list) whose source is gone as if just submitted:
        one of them may become the others' source."""
        for follower in followers:
            self._guarded(follower.job, self._admit, follower.job)

    def _hand_over(self, source: Active, cache: Any, tokens: list[int] | None) -> None:
        """A source has left the generator (finished, stopped, cancelled; already dropped):
        its followers start from what its cache holds; those it does not cover yet are placed
        again (a cancelled one's partial prefill is in the store by then). A cancelled sample
        thus never takes its siblings with it."""
        followers = [f for f in self._followers if f.share.key == source.uid]
        if not followers:
            return
        self._followers = [f for f in self._followers if f.share.key != source.uid]
        covered = [f for f in followers if tokens and len(tokens) >= f.share.tokens]
        if covered:
            self._fork_from(source, covered, (cache, tokens))
        self._restart_followers([f for f in followers if f not in covered])
