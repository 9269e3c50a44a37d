"""What the MoA arbiter is fed (past-tense events about workers) and what it decides.

The arbiter is a pure object: the orchestrator turns each worker's stream into these events,
passes them in with the clock reading ``now``, and carries out the decisions it gets back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.events import ErrorKind

Channel = Literal["text", "reasoning", "tool"]


@dataclass(frozen=True, slots=True)
class WorkerStarted:
    worker: str


@dataclass(frozen=True, slots=True)
class TokenArrived:
    """One content delta of a worker (a token or a few, as the upstream streams them)."""

    worker: str
    text: str
    channel: Channel = "text"
    logprob: float | None = None


@dataclass(frozen=True, slots=True)
class WorkerFinished:
    worker: str
    finish_reason: str = "stop"


@dataclass(frozen=True, slots=True)
class WorkerFailed:
    worker: str
    reason: str
    timeout: bool = False


WorkerEvent = WorkerStarted | TokenArrived | WorkerFinished | WorkerFailed


@dataclass(frozen=True, slots=True)
class Commit:
    """Splice this worker's stream (buffer first, then live) into the client's stream."""

    worker: str
    reason: str


@dataclass(frozen=True, slots=True)
class Cancel:
    """Stop this worker: its output will never be used."""

    worker: str


@dataclass(frozen=True, slots=True)
class Launch:
    """Start these waiting workers now (the vote's next wave)."""

    workers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StartReducer:
    """Run the aggregator over ``answers`` as worker ``worker``; ``fallback`` is the finished
    candidate to commit if the aggregator fails before its first token."""

    worker: str
    answers: tuple[tuple[str, str], ...]
    fallback: str | None


@dataclass(frozen=True, slots=True)
class StartJudge:
    """Ask a model which of ``options`` (candidate name, text) is best, as worker ``worker``;
    ``fallback`` is the most confident option, committed if the judge names none."""

    worker: str
    options: tuple[tuple[str, str], ...]
    fallback: str


@dataclass(frozen=True, slots=True)
class Fail:
    kind: ErrorKind
    message: str


Decision = Commit | Cancel | Launch | StartReducer | StartJudge | Fail
