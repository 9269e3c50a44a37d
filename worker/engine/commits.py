"""Prompt-cache commits after the response: finished jobs' caches held until their commit, and
the new jobs parked until a commit they would reuse lands (owner-thread state of the engine).

A finished job's KV cache is held as a pending commit until the HTTP layer calls
``Engine.commit`` (after writing the terminal frame). A new job whose prompt would reuse a
pending commit waits for it (at most ``commit_wait_s``), so it never reads a half-committed
cache and the client of the first job never waits for the bookkeeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.engine.types import EngineConfig, EngineStats, Job
from worker.prompt_cache.digest import block_hashes, common_blocks
from worker.prompt_cache.store import PromptCacheStore, cache_nbytes

# A next turn being built (worker/engine/next_turns.py) is waited for only when it would save
# more than this many prompt tokens: an agent's tool turn shares only the answer's close with a
# next turn rendered as a user's, not worth a wait behind the running rows.
BUILDING_WAIT_GAIN = 16


@dataclass
class Parked:
    job: Job
    waits_for: set[str]
    deadline: float


@dataclass
class Pending:
    tokens: list[int]
    cache: list[Any]
    nbytes: int  # counted once, when held: the memory budget reads the total every loop
    chain: tuple[int, ...] = ()  # block_hashes(tokens): routing counts a pending commit as held
    # An answer's next turn (worker/engine/next_turns.py), while still being prefilled to its
    # tokens (``building``: it never lands as it is).
    next_turn: bool = False
    building: bool = False
    created: float = field(default_factory=time.monotonic)


class Commits:
    """The pending commits (by job id) and the parked jobs, in front of the prompt cache."""

    def __init__(self, store: PromptCacheStore, config: EngineConfig, stats: EngineStats) -> None:
        self.store = store
        self.config = config
        self.stats = stats
        self.pending: dict[str, Pending] = {}
        self.parked: list[Parked] = []
        # The pending commits' block hashes, swapped in whole on every change so that the event
        # loop's thread can read them: a mesh asking "do you hold this prefix?" between an
        # answer and its commit hears yes (the next turn parks until the commit lands).
        self.held_chains: tuple[tuple[int, ...], ...] = ()

    def prefix_held(self, hashes: Sequence[int]) -> dict[str, Any]:
        """Tokens of a prompt (its block hashes, of the digest's block size) held in memory, on
        disk (with the disk's restore rate) and by a pending commit; safe from any thread."""
        size, store = self.store.digest_block_size, self.store
        memory, disk = store.held(hashes)
        pending = max((common_blocks(c, hashes) for c in self.held_chains), default=0)
        restore = store.disk.restore_tokens_per_second() if store.disk is not None else None
        return {"memory": memory * size, "disk": disk * size, "pending": pending * size, "restore_tok_s": restore}  # fmt: skip

    def _publish(self) -> None:
        self.held_chains = tuple(p.chain for p in self.pending.values() if p.chain)

    def park(self, job: Job) -> bool:
        """Park ``job`` when its prompt would reuse more of a pending commit than the store
        offers now; False: it can start at once."""
        prompt = job.request.prompt
        cached = self.store.best_prefix(prompt)
        waits = {
            job_id
            for job_id, pending in self.pending.items()
            if self.store.usable_prefix(pending.tokens, prompt, True)
            > cached + (BUILDING_WAIT_GAIN if pending.building else 0)
        }
        if not waits:
            return False
        self.stats.commit_waits += 1
        self.stats.log("parked", job.id)
        deadline = time.monotonic() + self.config.commit_wait_s
        self.parked.append(Parked(job, waits, deadline))
        return True

    def due(self) -> list[Job]:
        """The parked jobs to start now, in order (out of the parked list): those whose
        commits landed (or expired), and those that waited their longest."""
        if not self.parked:
            return []
        now = time.monotonic()
        due, still = [], []
        for parked in self.parked:
            if not (parked.waits_for & self.pending.keys()):
                due.append(parked.job)
            elif now >= parked.deadline:
                self.stats.commit_wait_timeouts += 1
                due.append(parked.job)
            else:
                still.append(parked)
        self.parked = still
        return due

    def waited_for(self) -> set[str]:
        """The pending commits some parked job waits for."""
        return {key for parked in self.parked for key in parked.waits_for}

    def next_deadline(self) -> float | None:
        return min((p.deadline for p in self.parked), default=None)

    def unpark(self, job: Job) -> None:
        self.parked = [p for p in self.parked if p.job is not job]

    def cancel(self, job_id: str) -> bool:
        """Take a parked job out (its client left); whether it was parked."""
        parked = [p for p in self.parked if p.job.id == job_id]
        self.parked = [p for p in self.parked if p.job.id != job_id]
        return bool(parked)

    def hold(
        self, job_id: str, tokens: list[int], cache: list[Any], *, building: bool = False
    ) -> None:
        chain = tuple(block_hashes(tokens, self.store.digest_block_size))
        nbytes = cache_nbytes(cache)
        self.pending[job_id] = Pending(tokens, cache, nbytes, chain, next_turn=building, building=building)  # fmt: skip
        self._publish()

    def land(self, job_id: str, before: Callable[[str], None] | None = None) -> None:
        """Commit a pending cache to the store (``before``: a test hook, called first)."""
        pending = self.pending.get(job_id)
        if pending is None or pending.building:
            return
        del self.pending[job_id]
        if before is not None:
            before(job_id)
        # Hashed once, when held; the digest has it before it leaves the pending commits.
        self.store.insert(pending.tokens, pending.cache, chain=pending.chain)
        self._publish()
        if pending.next_turn:
            self.stats.next_turns += 1
            self.stats.log("next_turn_landed", job_id)
        else:
            self.stats.commits += 1
            self.stats.log("committed", job_id)

    def drop(self, job_id: str) -> None:
        """Forget a pending commit without landing it."""
        if self.pending.pop(job_id, None) is not None:
            self._publish()

    def expire(self) -> None:
        """Drop the commits never requested within ``pending_commit_ttl_s``."""
        if not self.pending:
            return
        now = time.monotonic()
        expired = [j for j, p in self.pending.items() if now - p.created > self.config.pending_commit_ttl_s]  # fmt: skip
        for job_id in expired:
            del self.pending[job_id]
            self.stats.log("commit_expired", job_id)
        if expired:
            self._publish()

    @property
    def pending_bytes(self) -> int:
        """What the finished jobs' caches waiting for their commit hold."""
        return sum(p.nbytes for p in self.pending.values())

    def land_all(self) -> None:
        """Commit every pending cache (at shutdown: they go to disk with the rest); one still
        being built is dropped."""
        for job_id in list(self.pending):
            self.land(job_id)
        self.pending.clear()
        self._publish()

    def clear(self, *, forget_written: bool = False) -> None:
        """Forget the store's entries and the pending commits (parked jobs stay);
        ``forget_written``: also what this process wrote to the disk tier (the warm-up's)."""
        self.store.clear(forget_written=forget_written)
        self.pending.clear()
        self._publish()
