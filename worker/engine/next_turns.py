"""An answer's cache brought to the next turn's tokens, off the response path (owner thread).

The chat room says how the next turn will tokenize the conversation through an answer
(worker/chat/next_turn.py). Where that differs from what the answer's KV cache holds (the
answer re-tokenized, a dropped think block, the turn's close), the part the cache lacks is
prefilled here after the response went out, one chunk a round, on a
copy of the committed cache; the result lands in the prompt cache as one more entry. Until it
lands it is a pending commit: the mesh's routing-time question counts it as held and a next
turn that would reuse it parks until it lands (worker/engine/commits.py), so it never pays the
prefill twice. It runs while the engine has no rows, or for a parked next turn that waits for
it: on a busy engine, a client that sends back something else than the answer it got (the
lab's replayed sessions do) costs the running rows nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from worker.engine.commits import Commits
from worker.engine.sequential import prefill_into
from worker.prompt_cache.digest import common_prefix
from worker.prompt_cache.store import PromptCacheStore, cache_nbytes

log = logging.getLogger(__name__)


@dataclass
class _Prefill:
    key: str  # its pending commit's
    tokens: list[int]  # the next turn's
    cache: list[Any]  # holds tokens[:fed]
    fed: int


class NextTurns:
    """The answers' caches being brought to their next turn's tokens, oldest first."""

    def __init__(
        self,
        model: Any,
        store: PromptCacheStore,
        commits: Commits,
        *,
        step_size: int,
        max_tail: int,
    ) -> None:
        self._model = model
        self._store = store
        self._commits = commits
        self._step_size = step_size
        self._max_tail = max_tail  # longer tails are left to the next turn's own prefill
        self._queue: list[_Prefill] = []

    def __bool__(self) -> bool:
        return bool(self._queue)

    def plan(self, job_id: str, held: Sequence[int], next_turn: Sequence[int]) -> None:
        """After ``job_id``'s cache (``held`` tokens) landed: queue the prefill of what the
        next turn's tokens add to it, when there is something to add and it is short enough."""
        shared = common_prefix(held, next_turn)
        if shared == len(next_turn) or len(next_turn) - shared > self._max_tail:
            return
        cache, cached = self._store.fetch(next_turn, counted=False)
        if cache is None or len(next_turn) - cached > self._max_tail:
            return  # the answer's own entry is gone already (evicted): nothing to build on
        key = f"next-turn:{job_id}"
        tokens = list(next_turn)
        self._commits.hold(key, tokens, cache, building=True)
        self._queue.append(_Prefill(key, tokens, cache, cached))

    def step(self, busy: bool, wanted: Collection[str]) -> None:
        """Prefill one chunk of a queued next turn; land it when it is whole. First one a
        parked job waits for (``wanted``: pending commit keys); else, only while no rows run
        (``busy``), the oldest: a client that does not send the answer back as it got it (an
        edited history, a replay) never costs the running rows anything."""
        self._queue = [w for w in self._queue if w.key in self._commits.pending]  # not expired
        work = next((w for w in self._queue if w.key in wanted), None)
        if work is None and not busy and self._queue:
            work = self._queue[0]
        if work is None:
            return
        # Unasked (an idle engine's spare time), in small chunks: a request that arrives now
        # waits for one of them at most.
        size = self._step_size if work.key in wanted else max(32, self._step_size // 8)
        chunk = work.tokens[work.fed : work.fed + size]
        try:
            prefill_into(self._model, chunk, work.cache)
        except Exception:  # only the next turn's head start is lost, never the engine
            log.exception("prefilling the next turn of %s failed", work.key)
            self._queue.remove(work)
            self._commits.drop(work.key)
            return
        work.fed += len(chunk)
        self._commits.pending[work.key].nbytes = cache_nbytes(work.cache)
        if work.fed == len(work.tokens):
            self._queue.remove(work)
            self._commits.pending[work.key].building = False
            self._commits.land(work.key)
