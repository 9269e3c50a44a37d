"""How long a worker's answer may stay silent: its first token, and each gap after it. Pure.

A worker that stops answering (a deadlock, a stopped or swapped-out process) must not hold a
client forever. The node's health check finds a stuck worker within seconds and restarts it
(``mesh/worker_health.py``); these deadlines are the backstop on each stream, for an answer the
worker forgot while it otherwise looks well. So they are generous: a first token may follow a
long queue and a cold prefill of tens of thousands of tokens (minutes for a large model on a
Mac), and a running answer may wait out other requests' prefill chunks between two tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

FIRST_TOKEN_S = 600.0  # a 30k-token cold prefill of a 70B model on a Mac: 2-5 minutes, and a queue
IDLE_S = 120.0  # between tokens: a step can carry other requests' prefill chunks (~10-60 s)


@dataclass(frozen=True, slots=True)
class StreamDeadlines:
    """``first_token_s``: the most a worker stream may wait for its first answer line;
    ``idle_s``: the most between two lines after it. None: no deadline."""

    first_token_s: float | None = FIRST_TOKEN_S
    idle_s: float | None = IDLE_S

    def due(self, started: float, last_heard: float | None) -> float | None:
        """When a stream that started at ``started`` and was last heard from at ``last_heard``
        (None: not yet) runs out of time, on the same clock; None: never."""
        if last_heard is None:
            return None if self.first_token_s is None else started + self.first_token_s
        return None if self.idle_s is None else last_heard + self.idle_s

    def missed(self, heard: bool) -> str:
        """Why a stream that ran out of time did, in words (``heard``: it had answered)."""
        if heard:
            return f"the worker sent nothing for {self.idle_s:g} s mid-answer"
        return f"the worker sent no first token within {self.first_token_s:g} s"
