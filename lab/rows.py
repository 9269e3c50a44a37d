"""One row per probe request: the JSONL schema the probe writes and the reports read."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict

ApiName = Literal["chat", "responses", "messages"]
ProbeKind = Literal["models", "sentinel", "stream"]
API_NAMES: tuple[ApiName, ...] = ("chat", "responses", "messages")


class Outcome(StrEnum):
    """How the transport went. Whether the *answer* was right is ``sentinel_ok``, separately."""

    OK = "ok"  # complete response, terminal event seen
    ERROR_EVENT = "error_event"  # a proper error: an SSE error event or error body after 200
    HTTP_ERROR = "http_error"  # non-2xx status with an error body: proper or not, see below
    TIMEOUT = "timeout"  # no response head before the per-request deadline
    HUNG = "hung"  # response started but never terminated before the deadline: must be 0
    TRUNCATED = "truncated"  # body ended without a terminal event: an improper failure
    TRANSPORT_ERROR = "transport_error"  # connection refused/reset, malformed bytes


def is_proper_failure(outcome: Outcome, status: int | None, retry_after: str | None) -> bool:
    """Whether a failed request was the server saying "no" properly.

    An error event, a 4xx (404 while a model is gone, 429 with Retry-After), or a 503 that says
    when to come back: our gateway's answer when no route is up. Any other 5xx – 500, a 502 from
    our own gateway, 504, a bare 503 – is a bug or a timeout, as improper as a cut-off body.
    """
    if outcome is Outcome.ERROR_EVENT:
        return True
    if outcome is not Outcome.HTTP_ERROR or status is None:
        return False
    return status < 500 or (status == 503 and retry_after is not None)


class ProbeRow(BaseModel):
    """One probe. ``t`` is the wall-clock start (unix seconds); durations are in seconds."""

    model_config = ConfigDict(extra="forbid")

    t: float
    target: str = "a"  # which gateway (A/B mode: "a" or "b")
    url: str
    kind: ProbeKind
    model: str
    api: ApiName | None = None  # None for the models listing
    outcome: Outcome
    status: int | None = None
    error: str | None = None
    route: str | None = None  # x-route response header
    peer: str | None = None  # x-peer response header
    moa_winner: str | None = None  # x-moa-winner response header
    retry_after: str | None = None  # Retry-After response header (makes a 503 proper)
    ttft_s: float | None = None  # first content byte (stream) / full response (non-stream)
    duration_s: float
    tokens: int | None = None  # completion tokens (usage if reported, else content deltas)
    tok_s: float | None = None  # decode rate after the first token
    text: str | None = None  # the content that came back (compared across runs)
    sentinel_ok: bool | None = None  # sentinel probes only: did the exact word come back?

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    @property
    def failed_properly(self) -> bool:
        return is_proper_failure(self.outcome, self.status, self.retry_after)

    @property
    def failed_improperly(self) -> bool:
        """Hung, timed out, cut off, refused or an improper 5xx: what a fault must not cause."""
        return not self.ok and not self.failed_properly
