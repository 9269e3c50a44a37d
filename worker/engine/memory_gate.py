"""The jobs waiting for room in the worker's memory budget (worker/engine/budget.py), and the
spill that makes room: before a job waits, the prompt cache's memory tier gives its least
recently used entries to the disk tier (or drops them, without one). On the owner thread."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from worker.cpu.fast_path import physical_memory_bytes
from worker.engine.budget import MemoryBudget, default_limit
from worker.engine.load import kv_bytes_per_token, weight_bytes
from worker.engine.types import EngineConfig, Job
from worker.prompt_cache.store import PromptCacheStore


class MemoryGate:
    """Starts a job only when its projected KV fits the budget; the others wait, in order."""

    def __init__(
        self,
        budget: MemoryBudget,
        store: PromptCacheStore,
        pending_bytes: Callable[[], int],
    ) -> None:
        self.budget = budget
        self._store = store
        self._pending_bytes = pending_bytes
        self._waiting: deque[Job] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def refresh(self) -> None:
        """What the memory tier and the pending commits hold now; past the limit, the memory
        tier spills the excess. (A finished job's cache lands in the tier at its real size –
        mlx-lm grows a KV cache 256 positions at a time – which its reservation, by the token,
        can undercount: the lab saw the use 1 MiB over a 16 MiB budget until the next start.)"""
        self.budget.cache_bytes = self._store.nbytes + self._pending_bytes()
        over = -self.budget.room()
        if over > 0 and self._store.spill(over):
            self.budget.cache_bytes = self._store.nbytes + self._pending_bytes()

    def enter(self, job: Job) -> bool:
        """Reserve ``job``'s KV and say it may start, spilling the memory tier first if that
        makes room; otherwise it waits (False)."""
        if not self._waiting and self._reserve(job):
            return True
        self._waiting.append(job)
        return False

    def _reserve(self, job: Job) -> bool:
        request = job.request
        need = self.budget.need(len(request.prompt), request.max_tokens)
        self.refresh()
        if not self.budget.fits(need):
            self._store.spill(need - self.budget.room())
            self.refresh()
        if not self.budget.fits(need):
            return False
        self.budget.reserve(job.id, need)
        return True

    def due(self) -> list[Job]:
        """The waiting jobs that fit now, in order (reserved and out of the queue)."""
        started = []
        while self._waiting and self._reserve(self._waiting[0]):
            started.append(self._waiting.popleft())
        return started

    def stuck(self) -> Job | None:
        """The head of the queue when nothing runs that could free room for it (the memory
        tier is spilled already): it can never start here, out of the queue."""
        if not self._waiting or self.budget.running_bytes:
            return None
        return self._waiting.popleft()

    def cancel(self, job_id: str) -> Job | None:
        for job in self._waiting:
            if job.id == job_id:
                self._waiting.remove(job)
                return job
        return None

    def leave(self, job: Job) -> None:
        """``job`` ends (wherever it was): its reservation goes back, or its place in line.
        Safe to call more than once."""
        if job in self._waiting:
            self._waiting.remove(job)
        self.budget.release(job.id)

    def take_all(self) -> list[Job]:
        jobs = list(self._waiting)
        self._waiting.clear()
        return jobs


def memory_gate(
    config: EngineConfig, model: Any, store: PromptCacheStore, pending_bytes: Callable[[], int]
) -> MemoryGate | None:
    """The memory budget's gate for a loaded model, or None when there is no budget: the
    config's bytes, else 80 % of physical memory less the weights; 0, an unknown machine or a
    model whose KV size cannot be measured: none."""
    if config.memory_budget_bytes == 0:
        return None
    per_token = kv_bytes_per_token(model)
    if per_token is None:
        return None
    weights = weight_bytes(model)
    limit = config.memory_budget_bytes
    if limit is None:
        limit = default_limit(physical_memory_bytes(), weights)
    if limit is None:
        return None
    draft = config.speculation.draft_tokens if config.speculation.on else 0
    budget = MemoryBudget(limit, per_token, draft_tokens=draft, weight_bytes=weights)
    return MemoryGate(budget, store, pending_bytes)
