"""The engine's ends of jobs: cancelled, rejected, failed, shut down, each with its counters.

A cancelled job stores its cache at once (nobody is left to wait for): after its first token the
prompt and what it generated, during its prefill the prompt prefix of the chunks done, so a
client's retry of the same prompt resumes the prefill there. A source of followers hands them
its KV as it leaves (worker/engine/followers.py).

A mixin of :class:`worker.engine.core.Engine` (on its owner thread, on its state).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from worker.engine.followers import SharedPrefill
from worker.engine.jobs import Active, kept_through
from worker.engine.types import Failed, Job, JobEvent

if TYPE_CHECKING:
    from worker.engine.commits import Commits


class JobEnds(SharedPrefill):
    """Taking jobs out of the generator and the waiting lists."""

    _lock: threading.Lock
    _commits: Commits

    if TYPE_CHECKING:

        def _on_commit(self, job_id: str) -> None: ...

        def _reset_generator(self) -> None: ...

    def _on_cancel(self, job_id: str) -> None:
        if job_id in self._commits.pending:
            # Finished, but the client left before the commit: nobody waits on the response.
            self._on_commit(job_id)
            return
        parked = self._commits.cancel(job_id)
        waiting = [f for f in self._followers if f.job.id == job_id]
        if parked or waiting:
            self._followers = [f for f in self._followers if f.job.id != job_id]
            with self._lock:
                self.stats.queue_depth -= 1
                self.stats.cancelled += 1
            self.stats.log("cancelled", job_id)
        for active in list(self._active.values()):
            if active.job.id == job_id:
                self._stop(active)
                with self._lock:
                    self.stats.cancelled += 1
                self.stats.log("cancelled", job_id)

    def _reject(self, job: Job, message: str) -> None:
        self._commits.unpark(job)
        self._followers = [f for f in self._followers if f.job is not job]
        for uid, active in list(self._active.items()):
            if active.job is job:
                self._generator.remove([uid])
                self._drop(uid)
                break
        else:
            with self._lock:
                self.stats.queue_depth -= 1
        job._deliver(Failed(message))

    def _send(self, active: Active, event: JobEvent) -> bool:
        if active.job._deliver(event):
            return True
        self._stop(active)
        return False

    def _stop(self, active: Active) -> None:
        """Stop a job before its end; what its KV cache holds goes to the store. After the
        first token that is the prompt and the tokens so far: a client that interrupts and
        sends the conversation again (agent harnesses do) and MoA's cancelled losers then skip
        that prefill. During the prefill it is the prompt prefix of the chunks already done
        (both generators keep the token list equal to the cache after every chunk): a client
        that timed out on a long cold prefill retries from there, not from zero."""
        caches = self._generator.remove([active.uid], return_prompt_caches=True)
        cache, tokens = kept_through(active, *caches.get(active.uid, (None, None)))
        self._drop(active.uid)
        # Not yet prefilling (queued in the generator): the cache is the fetched copy of an
        # entry that is still in the store; nothing new to keep.
        if cache is not None and tokens and len(tokens) > active.cached_tokens:
            self._store.insert(list(tokens), cache)
            self.stats.log("cache_kept", active.job.id)
        self._hand_over(active, cache, tokens)

    def _drop(self, uid: int) -> None:
        active = self._active.pop(uid, None)
        if active is None:
            return
        with self._lock:
            if active.first_token:
                self.stats.in_flight -= 1
            else:
                self.stats.queue_depth -= 1

    def _fail_all(self, message: str) -> None:
        for uid, active in list(self._active.items()):
            active.job._deliver(Failed(message))
            self._drop(uid)
        self._reset_generator()
        # Followers ran nothing yet: they start on their own (the next loop's steps).
        followers, self._followers = self._followers, []
        self._restart_followers(followers)

    def _shutdown(self) -> None:
        for uid, active in list(self._active.items()):
            active.job._deliver(Failed("worker shutting down"))
            self._drop(uid)
        waiting = [p.job for p in self._commits.parked] + [f.job for f in self._followers]
        for job in waiting:
            job._deliver(Failed("worker shutting down"))
            with self._lock:
                self.stats.queue_depth -= 1
        self._commits.parked = []
        self._followers = []
        self._generator.close()
        self._commits.clear()
