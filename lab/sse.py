"""Server-sent events at the byte level: a sans-IO decoder (bytes in, frames out).

Follows the WHATWG event-stream rules that matter for measuring: lines end in CRLF, LF or CR
(a CR at the end of one chunk may pair with an LF at the start of the next), ``:`` lines are
comments (keep-alives), a blank line dispatches, ``data`` lines join with ``\\n``, a frame with
no data is not dispatched.
"""

from __future__ import annotations

from dataclasses import dataclass

_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True, slots=True)
class SSEFrame:
    event: str  # "message" when the frame named none
    data: str
    id: str | None = None


class SSEDecoder:
    """Feed raw body chunks; get complete frames. Counts comments so keep-alives are visible."""

    def __init__(self) -> None:
        self._buffer = b""
        self._pending_cr = False  # the last chunk ended in CR: a leading LF belongs to it
        self._started = False
        self._event = ""
        self._data: list[str] = []
        self._id: str | None = None
        self.comments = 0
        # The gateway's trailing ``: route x-peer=… x-attempts=…`` comment: the route facts that
        # were not settled when the response started (so not in its headers).
        self.route_facts: dict[str, str] = {}

    def feed(self, chunk: bytes) -> list[SSEFrame]:
        if not chunk:  # an empty read must not forget a CR that may pair with the next LF
            return []
        if self._pending_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._pending_cr = False
        buffer = self._buffer + chunk
        if not self._started:
            if len(buffer) < len(_BOM) and _BOM.startswith(buffer):
                self._buffer = buffer
                return []
            self._started = True
            if buffer.startswith(_BOM):
                buffer = buffer[len(_BOM) :]
        frames: list[SSEFrame] = []
        start = 0
        length = len(buffer)
        while start < length:
            lf = buffer.find(b"\n", start)
            cr = buffer.find(b"\r", start)
            if lf < 0 and cr < 0:
                break
            if cr >= 0 and (lf < 0 or cr < lf):
                end, next_start = cr, cr + 1
                if next_start < length and buffer[next_start : next_start + 1] == b"\n":
                    next_start += 1
                elif next_start == length:
                    self._pending_cr = True
            else:
                end, next_start = lf, lf + 1
            frame = self._line(buffer[start:end].decode("utf-8", errors="replace"))
            if frame is not None:
                frames.append(frame)
            start = next_start
        self._buffer = buffer[start:]
        return frames

    def _line(self, line: str) -> SSEFrame | None:
        if not line:
            return self._dispatch()
        if line.startswith(": route "):
            for pair in line[len(": route ") :].split():
                key, sep, value = pair.partition("=")
                if sep:
                    self.route_facts[key] = value
            return None  # a fact about the answer, not a keep-alive
        if line.startswith(":"):
            self.comments += 1
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        return None  # "retry" and unknown fields are ignored

    def _dispatch(self) -> SSEFrame | None:
        data, event = self._data, self._event
        self._data, self._event = [], ""
        if not data:
            return None
        return SSEFrame(event=event or "message", data="\n".join(data), id=self._id)

    @property
    def pending(self) -> bool:
        """True when bytes of an unfinished frame are buffered (a cut-off stream)."""
        return bool(self._buffer or self._data)
