"""Held writes: what a connection keeps back for its next flush, stream by stream.

``PeerConnection`` writes through an :class:`Outbox`; the flush's timing is the protocol's
(``protocol.py`` explains the coalescing as a whole). Held per stream so that a flush makes one
aioquic write (and one STREAM frame) per stream per datagram, not one per token: aioquic's
bookkeeping costs per write. The outbox sends only through the callable it is given (aioquic's
``send_stream_data``), so it is tested without a connection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

Send = Callable[[int, bytes, bool], None]  # (stream id, data, end_stream), as aioquic takes it


@dataclass(slots=True)
class _Held:
    """A stream's writes waiting for the connection's next flush."""

    chunks: list[bytes] = field(default_factory=list)
    fin: bool = False


class Outbox:
    """Stream writes on their way to aioquic: sent at once, or held for the next flush."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._held: dict[int, _Held] = {}  # stream id → writes waiting for the flush
        self._hooks: dict[int, Callable[[], None]] = {}  # stream id → its before_flush

    def write(self, stream_id: int, data: bytes, end_stream: bool, defer: bool) -> bool:
        """Send ``data`` now, or – ``defer`` – hold it for the flush. True when it was held."""
        if defer and end_stream and data and not self._others_held(stream_id):
            defer = False  # an End nobody else waits with goes at once: its stream is done
        if defer:
            held = self._held.get(stream_id)
            if held is None:
                self._held[stream_id] = held = _Held()
            held.chunks.append(data)
            held.fin = end_stream
        else:
            held = self._held.pop(stream_id, None)
            if held is not None:  # its own held writes go first: order within a stream is kept
                held.chunks.append(data)
                data = b"".join(held.chunks)
            self._send(stream_id, data, end_stream)
            self._send_held_fins()
        return defer

    def _send_held_fins(self) -> None:
        """Bare FINs held for the flush (``finish()`` after a response's End) ride with a
        datagram that leaves now: they carry no data, and alone each would cost a datagram
        (and its processing at the peer) of its own, just as the next request starts."""
        fins = [sid for sid, held in self._held.items() if held.fin and held.chunks == [b""]]
        for stream_id in fins:
            del self._held[stream_id]
            try:
                self._send(stream_id, b"", True)
            except (RuntimeError, ValueError):  # reset or finished meanwhile
                log.debug("stream %d: dropped a FIN held for a stream that ended", stream_id)

    def _others_held(self, stream_id: int) -> bool:
        """Whether streams other than ``stream_id`` wait for the next flush."""
        held, hooks = self._held, self._hooks
        return len(held) > (stream_id in held) or len(hooks) > (stream_id in hooks)

    def before_flush(self, stream_id: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` right before the next flush (it may write held writes)."""
        self._hooks[stream_id] = callback

    def flush(self) -> bool:
        """Hand the held writes to aioquic: first the streams' ``before_flush`` callbacks
        write what they gathered, then every held write goes. False when nothing was held
        (a FIN that left with another datagram, a reset)."""
        if self._hooks:
            hooks, self._hooks = self._hooks, {}
            for stream_id, hook in hooks.items():
                try:
                    hook()
                except Exception:  # a bug in one sender must not stop the others' flush
                    log.exception("stream %d: its before_flush callback failed", stream_id)
        if not self._held:
            return False
        held_writes, self._held = self._held, {}
        for stream_id, held in held_writes.items():
            try:
                self._send(stream_id, b"".join(held.chunks), held.fin)
            except (RuntimeError, ValueError):  # reset or finished meanwhile: nobody reads it
                log.debug("stream %d: dropped writes held for a stream that ended", stream_id)
        return True

    def drop(self, stream_id: int) -> None:
        """The stream's sending side is gone (reset): what it held cannot go."""
        self._held.pop(stream_id, None)
        self._hooks.pop(stream_id, None)

    def stream_done(self, stream_id: int) -> None:
        self._hooks.pop(stream_id, None)

    def clear(self) -> None:
        self._held.clear()
        self._hooks.clear()
