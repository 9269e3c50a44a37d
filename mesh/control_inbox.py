"""What arrives on a link's control stream once the link is up, handed out by kind.

A newer peer may send a control kind, a gossip type or a field this node does not know, and a
buggy or hostile one may send a value that does not validate. Neither is a reason to end the
link: the link carries the peer's requests, and cutting it again on every reconnect would cut a
newer node off for good. So a message that cannot be used is dropped alone, counted by reason
(``/api/status``: ``node.ignored``) and logged at most once a minute per reason.
:class:`IgnoredInput` is the pure tally (fed ``now``); :class:`ControlInbox` dispatches.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mesh.errors import MeshError
from mesh.identity import short_id

log = logging.getLogger(__name__)

LOG_EVERY_S = 60.0  # one line per reason per minute: a chatty newer peer must not flood the log
MAX_REASONS = 64  # reasons carry a peer's words (a type name): past this many, "other"

# (peer id, body) → None; raises MeshError for a body it cannot use.
ControlHandler = Callable[[str, dict[str, Any]], None]


@dataclass
class IgnoredInput:
    """Peer input this node did not use, counted by reason; says when a reason is due a log."""

    log_every_s: float = LOG_EVERY_S
    counts: Counter[str] = field(default_factory=Counter)
    _logged_at: dict[str, float] = field(default_factory=dict)
    _since_log: Counter[str] = field(default_factory=Counter)

    def note(self, reason: str, now: float) -> int:
        """Count one; returns how many of ``reason`` to report in a log line now (0: not due)."""
        if reason not in self.counts and len(self.counts) >= MAX_REASONS:
            reason = "other"
        self.counts[reason] += 1
        self._since_log[reason] += 1
        last = self._logged_at.get(reason)
        if last is not None and now - last < self.log_every_s:
            return 0
        self._logged_at[reason] = now
        return self._since_log.pop(reason)


@dataclass
class ControlInbox:
    """Hands each control frame's body to the handler of its kind; unknown kinds and bodies a
    handler refuses (``MeshError``) are counted in ``ignored`` and never end the link."""

    handlers: dict[str, ControlHandler]
    ignored: IgnoredInput = field(default_factory=IgnoredInput)

    def receive(self, peer_id: str, kind: str, body: dict[str, Any], now: float) -> None:
        handler = self.handlers.get(kind)
        if handler is None:
            self.ignore(peer_id, f"unknown control kind {kind[:32]!r}", now)
            return
        try:
            handler(peer_id, body)
        except MeshError as exc:
            self.ignore(peer_id, str(exc)[:120], now)

    def ignore(self, peer_id: str, reason: str, now: float) -> None:
        count = self.ignored.note(reason, now)
        if count:
            # Formatted here: the node's repeated-line filter keys on the message text, and a
            # line per reason is what this rate limit already allows.
            log.info(
                f"ignored {count} control message(s) (latest from {short_id(peer_id)}): {reason}"
            )
