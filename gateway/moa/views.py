"""One worker's stream as the MoA arbiter sees it: status, first token, text, confidence."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gateway.moa import gates, scoring


class WorkerStatus(enum.Enum):
    WAITING = "waiting"  # vote: a later wave's sample, not started (yet)
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass
class WorkerView:
    """Everything the arbiter knows about one worker's stream so far."""

    name: str
    started_at: float
    status: WorkerStatus = WorkerStatus.RUNNING
    first_token_at: float | None = None
    tokens: int = 0
    text: str = ""
    reasoning: str = ""
    tool_calls: int = 0
    logprob_sum: float = 0.0
    logprob_count: int = 0
    failure: str | None = None
    timed_out: bool = False
    finish_reason: str | None = None

    @property
    def mean_logprob(self) -> float | None:
        return scoring.mean_logprob(self.logprob_sum, self.logprob_count)

    @property
    def alive(self) -> bool:
        return self.status in (WorkerStatus.RUNNING, WorkerStatus.FINISHED, WorkerStatus.WAITING)

    @property
    def waiting(self) -> bool:
        return self.status is WorkerStatus.WAITING

    @property
    def running(self) -> bool:
        return self.status is WorkerStatus.RUNNING

    @property
    def finished(self) -> bool:
        return self.status is WorkerStatus.FINISHED

    def verdict(self) -> gates.Verdict:
        return gates.judge(self.text, reasoning=self.reasoning, tool_calls=self.tool_calls)
