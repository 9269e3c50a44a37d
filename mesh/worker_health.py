"""A worker's health, from the node's periodic ``/health`` checks. Pure: fed outcomes and ``now``.

A worker can stop answering while its process lives: a deadlock, a ``SIGSTOP``, a machine
swapping itself to a halt. Its requests would then wait for ever, and the node would go on
advertising its model. The supervisor (``mesh/workers.py``) asks each worker's ``/health``
every ``interval_s``; a check is *missed* when no answer comes within that interval, or when the
answer says the engine has sat in one step for more than ``stall_s`` (its event loop still
answers, but no token moves). ``misses`` missed checks in a row make the worker stuck: the node
withdraws its model (gossip stops advertising it, the local router stops choosing it), kills
the process (SIGKILL: a stopped process ignores SIGTERM) and restarts it. One answer in time
resets the count, so a worker that is only slow now and then is left alone.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HealthOptions:
    """How a node checks its workers (``mesh up --worker-health-interval/-misses
    --worker-stall-timeout``). ``interval_s`` 0 turns the checks off."""

    interval_s: float = 2.0
    misses: int = 3  # in a row: a stopped worker is found in about misses × interval_s
    stall_s: float = 300.0  # one step this long counts as a miss (a prefill chunk: seconds)


class Health(enum.Enum):
    HEALTHY = "healthy"
    MISSING = "missing"  # missed the last check(s), fewer than ``misses`` in a row
    STUCK = "stuck"  # missed ``misses`` in a row: withdraw, kill, restart (final)


class HealthCheck:
    """One running worker's checks, from its start (a restarted worker gets a new one)."""

    def __init__(self, name: str, options: HealthOptions, now: float) -> None:
        self.name = name
        self.options = options
        self.state = Health.HEALTHY
        self.missed = 0  # checks missed in a row
        self.last_answer = now  # when it last answered well (its start counts)
        self.why = ""  # why the last check was missed

    def answered(self, now: float, body: dict[str, Any]) -> Health:
        """The worker answered its check within the interval with ``body``."""
        busy = body.get("engine_busy_s")
        if isinstance(busy, int | float) and busy > self.options.stall_s:
            return self._miss(f"its engine has been in one step for {busy:.0f} s")
        if self.state is not Health.STUCK:
            self.missed = 0
            self.last_answer = now
            self._set_state(Health.HEALTHY)
        return self.state

    def no_answer(self, now: float) -> Health:
        """The check got no answer within the interval (or not a 200 with JSON)."""
        return self._miss(f"no answer to its health check for {now - self.last_answer:.1f} s")

    def _miss(self, why: str) -> Health:
        if self.state is Health.STUCK:
            return self.state  # final: the worker is being replaced
        self.missed += 1
        self.why = why
        self._set_state(Health.STUCK if self.missed >= self.options.misses else Health.MISSING)
        return self.state

    def _set_state(self, state: Health) -> None:
        if state is self.state:
            return
        # One message per target state: the node's log filter holds back repeats of a message.
        if state is Health.HEALTHY:
            log.info("worker %s: %s -> healthy (it answers)", self.name, self.state.value)
        else:
            template = "worker %s: %s -> " + state.value + " (%s)"
            log.warning(template, self.name, self.state.value, self.why)
        self.state = state

    def status(self, now: float) -> dict[str, Any]:
        """For ``/api/status``: the state, the checks missed in a row, seconds since an answer."""
        return {
            "state": self.state.value,
            "missed": self.missed,
            "last_answer_s": round(now - self.last_answer, 1),
        }
