"""Tunnel frame codec: pure, sans-IO. Bytes in, frames out; frames in, bytes out.

Wire format of one frame: ``type (u8) | length (u32, big endian) | payload``; a payload is at
most ``MAX_PAYLOAD`` bytes (1 MiB), larger → ``FrameError``.

One proxied request = one bidirectional QUIC stream::

    requester → responder   RequestHead  Body*  BodyEnd
    responder → requester   ResponseHead Data*  End        (or just End: failed before a head)

``End(code=ErrorCode.NO_ERROR)`` is success; any other code is a failure with HTTP/3-like
meaning (REJECTED = not processed, safe to retry; CANCELLED; UPSTREAM_FAILED; DEADLINE;
INTERNAL; PROTOCOL). A response is complete only when ``End`` arrived: EOF before it is a
failure (``InboundSequence.check_eof`` raises ``IncompleteResponse``).

``Control(kind, body)`` carries connection-level messages (auth, gossip) on the control stream;
``Window(consumed)`` is the tunnel's own per-stream credit (flow control), never surfaced to
users. Head/End/Control payloads are JSON (orjson) validated by pydantic; Body/Data are raw.

Decoding arbitrary bytes raises only ``FrameError`` (hypothesis-tested)::

    dec = FrameDecoder()
    for frame in dec.feed(chunk): ...
    dec.check_eof()          # FrameError if a frame was cut off
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mesh.errors import FrameError, IncompleteResponse, ProtocolViolation

MAX_PAYLOAD = 1 << 20
_HEADER = struct.Struct(">BI")
HEADER_SIZE = _HEADER.size
_U64 = struct.Struct(">Q")


class FrameType(enum.IntEnum):
    REQUEST_HEAD = 0x01
    BODY = 0x02
    BODY_END = 0x03
    RESPONSE_HEAD = 0x04
    DATA = 0x05
    END = 0x06
    CONTROL = 0x07
    WINDOW = 0x08


class ErrorCode(enum.IntEnum):
    """Codes for ``End`` frames, stream resets and connection closes (QUIC application codes)."""

    NO_ERROR = 0x00
    PROTOCOL = 0x01  # the peer broke the frame protocol
    INTERNAL = 0x02  # a bug or unexpected failure on the sender's side
    REJECTED = 0x03  # not processed at all: safe to retry elsewhere
    CANCELLED = 0x04  # the requester no longer wants the response
    UPSTREAM_FAILED = 0x05  # the serving worker failed
    DEADLINE = 0x06  # the request's deadline passed
    # connection close codes
    AUTH_FAILED = 0x10  # unauthenticated / pin mismatch: nothing but this close
    DUPLICATE_NODE = 0x11  # the peer has our node id (copied home dir)
    SUPERSEDED = 0x12  # a simultaneous dial collapsed: the other connection is kept
    PING_TIMEOUT = 0x13  # the peer stopped acknowledging pings
    SHUTDOWN = 0x14  # the node is shutting down cleanly


def error_name(code: int | None) -> str:
    """Readable name for a code, also for codes this version does not know."""
    if code is None:
        return "none"
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"0x{code:x}"


class _JsonFrame(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class RequestHead(_JsonFrame):
    """Start of a proxied request. ``deadline``: seconds left when sent (relative, so clock skew
    between nodes does not matter); ``attempt``: 0 first try, 1 the retry."""

    id: str = Field(max_length=256)
    method: str = Field(default="POST", max_length=16)
    path: str = Field(max_length=4096)
    headers: dict[str, str] = Field(default_factory=dict)
    deadline: float | None = Field(default=None, ge=0)
    attempt: int = Field(default=0, ge=0, le=1000)


class ResponseHead(_JsonFrame):
    status: int = Field(ge=100, le=599)
    headers: dict[str, str] = Field(default_factory=dict)


class End(_JsonFrame):
    """Last frame of a response. ``code == NO_ERROR`` means success."""

    code: ErrorCode = ErrorCode.NO_ERROR
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.code == ErrorCode.NO_ERROR


class Control(_JsonFrame):
    """A connection-level message (auth, gossip, ...). Its schema belongs to ``kind``'s owner."""

    kind: str = Field(max_length=64)
    body: dict[str, Any] = Field(default_factory=dict)


# Body and Data are made once per token on both ends: not frozen, because a frozen
# dataclass's __init__ costs three times a plain one's. Treat them as immutable all the same.
@dataclass(slots=True)
class Body:
    data: bytes


@dataclass(frozen=True, slots=True)
class BodyEnd:
    pass


@dataclass(slots=True)
class Data:
    data: bytes


@dataclass(frozen=True, slots=True)
class Window:
    """Receiver → sender credit: total payload bytes consumed so far on this stream."""

    consumed: int


Frame = RequestHead | Body | BodyEnd | ResponseHead | Data | End | Control | Window

_JSON_TYPES: dict[type, FrameType] = {
    RequestHead: FrameType.REQUEST_HEAD,
    ResponseHead: FrameType.RESPONSE_HEAD,
    End: FrameType.END,
    Control: FrameType.CONTROL,
}


_RAW_TYPES: dict[type, FrameType] = {Data: FrameType.DATA, Body: FrameType.BODY}


def _payload(frame: Frame) -> tuple[FrameType, bytes]:
    raw = _RAW_TYPES.get(type(frame))
    if raw is not None:
        return raw, frame.data  # type: ignore[union-attr]
    if isinstance(frame, BodyEnd):
        return FrameType.BODY_END, b""
    if isinstance(frame, Window):
        if not 0 <= frame.consumed < 1 << 64:
            raise FrameError(f"window out of range: {frame.consumed}")
        return FrameType.WINDOW, _U64.pack(frame.consumed)
    ftype = _JSON_TYPES.get(type(frame))
    if ftype is None or not isinstance(frame, _JsonFrame):
        raise FrameError(f"not a frame: {type(frame).__name__}")
    try:
        return ftype, orjson.dumps(frame.model_dump(mode="json"))
    except orjson.JSONEncodeError as exc:
        raise FrameError(f"cannot encode {ftype.name}: {exc}") from None


def encode(frame: Frame) -> bytes:
    """Bytes for one frame. ``FrameError`` if its payload exceeds ``MAX_PAYLOAD``."""
    ftype, payload = _payload(frame)
    if len(payload) > MAX_PAYLOAD:
        raise FrameError(f"{ftype.name} payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return _HEADER.pack(ftype, len(payload)) + payload


def _json(model: type[RequestHead | ResponseHead | End | Control]) -> Callable[[bytes], Frame]:
    def parse(payload: bytes) -> Frame:
        try:
            return model.model_validate(orjson.loads(payload))
        except (orjson.JSONDecodeError, ValidationError) as exc:
            raise FrameError(f"bad {model.__name__} payload: {exc}") from None

    return parse


def _body_end(payload: bytes) -> Frame:
    if payload:
        raise FrameError("BODY_END carries no payload")
    return BodyEnd()


def _window(payload: bytes) -> Frame:
    if len(payload) != _U64.size:
        raise FrameError("WINDOW payload must be 8 bytes")
    return Window(_U64.unpack(payload)[0])


_DECODERS: dict[int, Callable[[bytes], Frame]] = {
    FrameType.REQUEST_HEAD: _json(RequestHead),
    FrameType.BODY: Body,
    FrameType.BODY_END: _body_end,
    FrameType.RESPONSE_HEAD: _json(ResponseHead),
    FrameType.DATA: Data,
    FrameType.END: _json(End),
    FrameType.CONTROL: _json(Control),
    FrameType.WINDOW: _window,
}


class FrameDecoder:
    """Incremental decoder: ``feed`` bytes as they arrive, get whole frames back.

    After a ``FrameError`` the decoder is poisoned (the stream is unrecoverable) and every
    further ``feed`` raises again."""

    def __init__(self, max_payload: int = MAX_PAYLOAD) -> None:
        self._buf = bytearray()  # the start of a frame not yet whole
        self._need = HEADER_SIZE  # bytes that frame needs, as far as its header tells
        self._max = max_payload
        self._error: FrameError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held that do not yet form a whole frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Frame]:
        """Frames completed by ``data`` (possibly none). ``FrameError`` on malformed input."""
        return [frame for frame, _ in self.feed_sized(data)]

    def feed_sized(self, data: bytes) -> list[tuple[Frame, int]]:
        """Like ``feed``, with each frame's size on the wire (for flow-control accounting)."""
        if self._error is not None:
            raise self._error
        if self._buf:
            # A frame cut across chunks: gather it (a 1 MiB body comes in ~1 KiB pieces, so
            # parse only once it can be whole), then go on from one immutable buffer.
            self._buf += data
            if len(self._buf) < self._need:
                return []
            data, self._buf = bytes(self._buf), bytearray()
        elif not isinstance(data, bytes):
            data = bytes(data)
        try:
            frames, pos = self._parse(data)
        except FrameError as exc:
            self._error = exc
            raise
        if pos < len(data):
            self._buf = bytearray(data[pos:])
        return frames

    def _parse(self, data: bytes) -> tuple[list[tuple[Frame, int]], int]:
        """The whole frames at the start of ``data``, and where the first partial one begins."""
        frames: list[tuple[Frame, int]] = []
        pos, size = 0, len(data)
        self._need = HEADER_SIZE
        while size - pos >= HEADER_SIZE:
            ftype, length = _HEADER.unpack_from(data, pos)
            decode = _DECODERS.get(ftype)
            if decode is None:
                raise FrameError(f"unknown frame type 0x{ftype:02x}")
            if length > self._max:
                raise FrameError(f"frame of {length} bytes exceeds {self._max}")
            end = pos + HEADER_SIZE + length
            if end > size:
                self._need = HEADER_SIZE + length
                break
            frames.append((decode(data[pos + HEADER_SIZE : end]), HEADER_SIZE + length))
            pos = end
        return frames, pos

    def check_eof(self) -> None:
        """Call at end of input: ``FrameError`` if a partial frame is left over."""
        if self._buf:
            raise FrameError(f"input ended inside a frame ({len(self._buf)} bytes left)")


class StreamRole(enum.Enum):
    """Which frames a stream's inbound side may carry."""

    RESPONSE = "response"  # we opened it: the peer answers with ResponseHead Data* End
    REQUEST = "request"  # the peer opened it: RequestHead Body* BodyEnd
    CONTROL = "control"  # Control frames only, for the connection's lifetime


_RESPONSE_ORDER: dict[tuple[str, type], str] = {
    ("head", ResponseHead): "data",
    ("head", End): "done",
    ("data", Data): "data",
    ("data", End): "done",
}
_REQUEST_ORDER: dict[tuple[str, type], str] = {
    ("head", RequestHead): "body",
    ("body", Body): "body",
    ("body", BodyEnd): "done",
}
_CONTROL_ORDER: dict[tuple[str, type], str] = {("head", Control): "head"}
_ORDERS = {
    StreamRole.RESPONSE: _RESPONSE_ORDER,
    StreamRole.REQUEST: _REQUEST_ORDER,
    StreamRole.CONTROL: _CONTROL_ORDER,
}


class InboundSequence:
    """Checks the order of frames arriving on one stream, and whether its EOF is a success.

    ``accept`` raises ``ProtocolViolation`` for a frame out of order; ``check_eof`` raises
    ``IncompleteResponse`` when the input ended before its terminal frame (End / BodyEnd)."""

    def __init__(self, role: StreamRole) -> None:
        self.role = role
        self._order = _ORDERS[role]
        self._state = "head"

    @property
    def complete(self) -> bool:
        return self._state == "done"

    def accept(self, frame: Frame) -> None:
        nxt = self._order.get((self._state, type(frame)))
        if nxt is None:
            raise ProtocolViolation(
                f"{type(frame).__name__} not allowed in state {self._state!r} of a "
                f"{self.role.value} stream"
            )
        self._state = nxt

    def check_eof(self) -> None:
        if not self.complete:
            what = "End" if self.role is StreamRole.RESPONSE else "terminal frame"
            raise IncompleteResponse(
                f"{self.role.value} stream ended without its {what} (state {self._state!r})"
            )
