"""One memory budget per worker: the running rows' KV, the pending commits and the prompt cache's
memory tier count against it. Pure: the engine feeds it sizes, it answers whether a job fits.

A job reserves its projected KV when it starts running – (prompt + ``max_tokens`` + a verify
pass's drafts) × the model's KV bytes per token, measured at load – and gives it back when its row
leaves. A job that does not fit waits; the engine first spills the memory tier to disk (or drops
it, without a disk tier) before it lets anything wait, and refuses a new request with a 429 and
``Retry-After`` only when ``max_waiting`` jobs already wait. A job larger than the whole budget can
never run here: a 413.

The default budget is what the machine can give without swapping, less the weights: 80 % of
physical memory minus the model's bytes (``default_limit``); ``--memory-gb`` sets it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_SHARE = 0.8  # of physical memory: the rest is the OS's, the gateway's, other processes'
DEFAULT_MAX_WAITING = 64
RETRY_AFTER_S = 2


class BudgetRefusal(Exception):
    """A request the budget cannot take now (``status`` 429, with ``retry_after_s``) or ever
    (413)."""

    def __init__(self, message: str, status: int, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


def default_limit(physical_bytes: int | None, weight_bytes: int) -> int | None:
    """80 % of physical memory less the weights; None (no budget) when memory is unknown."""
    if physical_bytes is None:
        return None
    return max(0, int(physical_bytes * DEFAULT_SHARE) - weight_bytes)


@dataclass
class MemoryBudget:
    """Bytes reserved by running jobs against ``limit``; ``kv_bytes_per_token`` of the model."""

    limit: int
    kv_bytes_per_token: int
    draft_tokens: int = 0  # a verify pass holds this many more positions a row
    max_waiting: int = DEFAULT_MAX_WAITING
    reserved: dict[str, int] = field(default_factory=dict)  # job id → bytes
    cache_bytes: int = 0  # the memory tier and the pending commits, as last told
    weight_bytes: int = 0  # the model's parameters as loaded: outside the budget, reported

    def need(self, prompt_tokens: int, max_tokens: int) -> int:
        tokens = prompt_tokens + max_tokens + self.draft_tokens
        return tokens * self.kv_bytes_per_token

    @property
    def running_bytes(self) -> int:
        return sum(self.reserved.values())

    @property
    def used(self) -> int:
        return self.running_bytes + self.cache_bytes

    def room(self) -> int:
        return self.limit - self.used

    def fits(self, need: int) -> bool:
        return need <= self.room()

    def check_submit(self, need: int, queued: int) -> None:
        """On submit (the event loop): raise :class:`BudgetRefusal` for a job that can never
        fit, or that would wait behind ``max_waiting`` others (``queued``: submitted jobs with
        no token yet) while it does not fit now."""
        if need > self.limit:
            raise BudgetRefusal(
                f"this request's KV cache ({need >> 20} MiB) is larger than the worker's memory"
                f" budget ({self.limit >> 20} MiB): send a shorter prompt or fewer max_tokens",
                413,
            )
        if queued >= self.max_waiting and need > self.limit - self.running_bytes:
            raise BudgetRefusal(
                f"the worker's memory budget is taken ({queued} requests wait)",
                429,
                RETRY_AFTER_S,
            )

    def reserve(self, job_id: str, need: int) -> None:
        self.reserved[job_id] = need

    def release(self, job_id: str) -> None:
        self.reserved.pop(job_id, None)

    def as_dict(self) -> dict[str, int]:
        return {
            "limit_bytes": self.limit,
            "used_bytes": self.used,
            "running_kv_bytes": self.running_bytes,
            "prompt_cache_bytes": self.cache_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "weight_bytes": self.weight_bytes,
        }
