"""Text deltas of one relayed response that wait for the same tunnel flush, merged into one.

A free-running engine's tokens come faster than the tunnel flushes (``flush_delay``): each
token would cost its own JSON event and DATA frame on the serving side, and a frame to parse,
a JSON event to decode and an event to pass on at the requester. Merged, the deltas that wait
for one flush are one delta with their texts concatenated – the event a worker that streams
bigger chunks sends anyway, so a peer of any version reads it as it is (nothing on the wire
changes; nothing to negotiate). Pure; the tunnel server drives it (``tunnel_server.py``).

Rules – the client sees the same text in the same order, never later:

- only plain ``TextDelta`` merge: a delta with a per-token field (a ``logprob``: MoA scores
  each one) never does, nor a ``ReasoningDelta`` (the Responses API counts reasoning deltas
  as its ``reasoning_tokens``), nor any other event;
- only neighbours: any other event (a reasoning or tool-call delta, usage, the terminal)
  closes the merge, which is sent before it;
- never the first content event: the caller sends it at once (the client's TTFT);
- at most ``max_chars`` per merged delta.

A real engine's tokens (10–150 ms apart) come after the previous flush, so they never merge:
only a connection carrying hundreds of tokens a second sees merged deltas.
"""

from __future__ import annotations

from gateway.events import Event, TextDelta

MAX_CHARS = 4096


def mergeable(event: Event) -> bool:
    """Whether ``event`` may be merged with its neighbours (a plain text delta)."""
    return type(event) is TextDelta and event.logprob is None


class DeltaMerge:
    """The deltas gathered for the next flush: ``add`` them, ``take`` the merged one."""

    def __init__(self, max_chars: int = MAX_CHARS) -> None:
        self._max = max_chars
        self._parts: list[str] = []
        self._chars = 0

    @property
    def pending(self) -> bool:
        """Something is gathered (the caller then has a flush to wait for)."""
        return bool(self._parts)

    def add(self, delta: TextDelta) -> TextDelta | None:
        """Gather ``delta`` (``mergeable`` must be true of it). Returns the merged delta it
        could not join (``max_chars`` reached), to be sent now, before it."""
        text = delta.text
        closed = None
        if self._chars + len(text) > self._max and self._parts:
            closed = self.take()
        self._parts.append(text)
        self._chars += len(text)
        return closed

    def take(self) -> TextDelta | None:
        """The merged delta of everything gathered (None if nothing is); empties the merge."""
        parts = self._parts
        if not parts:
            return None
        text = parts[0] if len(parts) == 1 else "".join(parts)
        self._parts, self._chars = [], 0
        return TextDelta(text)
