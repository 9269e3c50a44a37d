"""One bidirectional tunnel stream: frames in both directions, credit-based backpressure.

Created by ``PeerConnection`` (see ``mesh/tunnel/__init__.py`` for the whole API); users call
``send``, ``recv``, ``finish``, ``reset`` and iterate it.

Why credit frames: aioquic grants QUIC flow-control credit as soon as bytes arrive, not when the
application consumes them, so QUIC alone never slows a sender down for a slow reader. Each
direction therefore has a window (``TunnelConfig.stream_window`` bytes of frames): the reader
returns credit with ``Window(consumed)`` frames as ``recv`` hands frames out, and ``send`` waits
while ``window`` bytes are unconsumed. Memory per stream is bounded on both sides by about
``window + one frame``. Once the peer finished its sending side it can no longer return credit,
so from then on our sends are not limited (the protocol never needs that case to be bounded:
the requester finishes only after the response's ``End``).

Terminal frames finish our sending side automatically: sending ``End`` (the responder's last
frame) and receiving ``End`` (the requester has nothing more to say) both send the QUIC FIN.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from mesh.errors import (
    ClosedError,
    ConnectionLost,
    FrameError,
    MeshError,
    ProtocolViolation,
    StreamLost,
    StreamReset,
    TunnelError,
)
from mesh.tunnel.frames import (
    HEADER_SIZE,
    MAX_PAYLOAD,
    Body,
    BodyEnd,
    Data,
    End,
    ErrorCode,
    Frame,
    FrameDecoder,
    InboundSequence,
    StreamRole,
    Window,
    encode,
    error_name,
)

log = logging.getLogger(__name__)
_MAX_FRAME = HEADER_SIZE + MAX_PAYLOAD


class StreamHost(Protocol):
    """What a stream needs from its connection (``PeerConnection`` implements it, and
    ``testing.PipeHost``). The stream's own members the connection calls are under "called
    by the connection" in :class:`TunnelStream`."""

    def stream_write(
        self, stream_id: int, data: bytes, end_stream: bool, defer: bool = False
    ) -> None:
        """Queue ``data``; ``defer``: it may wait a moment to share a datagram (a token)."""

    def stream_before_flush(self, stream_id: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` right before the next flush of deferred writes."""

    def stream_abort(self, stream_id: int, code: int, send: bool, receive: bool) -> None:
        """Reset our sending side (``send``) and/or stop the peer's (``receive``)."""

    def stream_done(self, stream_id: int) -> None:
        """Both directions are over: forget the stream."""

    def lost_error(self) -> ConnectionLost | None:
        """What the connection died of; None while it lives."""


class TunnelStream:
    """A bidirectional stream of frames. Not created directly: ``PeerConnection.open_stream``
    (role RESPONSE: we request, the peer responds) or ``on_stream`` (role REQUEST)."""

    def __init__(self, host: StreamHost, stream_id: int, role: StreamRole, window: int) -> None:
        self.stream_id = stream_id
        self.role = role
        self._host = host
        self._window = window
        self._decoder = FrameDecoder()
        self._sequence = InboundSequence(role)
        self._inbound: deque[tuple[Frame, int]] = deque()
        self._readable = asyncio.Event()
        self._broken = asyncio.Event()  # set once _error is: reset, stopped, lost, violated
        self._error: TunnelError | FrameError | None = None
        self._remote_finished = False
        self._received = 0  # frame bytes received (Window frames excluded)
        self._consumed = 0
        self._advertised = 0
        # sending side
        self._local_finished = False
        self._sent = 0
        self._send_limit = window
        self._writable = asyncio.Event()
        self._writable.set()

    # ---- public API ----

    @property
    def done(self) -> bool:
        """Both directions are over (finished, reset or lost)."""
        return self._local_finished and self._remote_finished

    @property
    def unconsumed_sent(self) -> int:
        """Bytes we sent that the peer's reader has not consumed yet (bounded by the window)."""
        return max(0, self._sent - (self._send_limit - self._window))

    @property
    def error(self) -> TunnelError | FrameError | None:
        """Why the stream broke (what ``wait_broken`` returns); None while it has not."""
        return self._error

    async def send(self, frame: Frame, *, defer: bool = False) -> None:
        """Send one frame; waits while the peer's reader is a window behind (backpressure).

        ``defer``: the frame may wait up to ``TunnelConfig.flush_delay`` to share a datagram
        with the frames after it (a response's tokens after the first); any frame sent without
        it takes the waiting ones along at once. A deferred ``End`` waits only for a flush that
        other streams' writes wait for too (a busy connection); else it goes at once.

        Raises ``ClosedError`` after our own finish/reset, ``StreamReset`` if the peer stopped
        the stream, ``ConnectionLost`` if the connection died. Sending ``End`` finishes."""
        if isinstance(frame, Window):
            raise ValueError("Window frames belong to the tunnel's flow control")
        data = encode(frame)
        self._raise_if_unsendable()
        if self._sent >= self._send_limit and not self._remote_finished:
            await self.wait_credit()
        end = type(frame) is End
        self._sent += len(data)
        self._host.stream_write(self.stream_id, data, end, defer)
        if end:
            self._finish_local()

    async def wait_credit(self) -> None:
        """Wait until the peer's reader leaves room for another frame (what ``send`` waits
        for first); raises like ``send``. For a sender that gathers a frame for
        ``send_held``: it waits here when it begins gathering."""
        self._raise_if_unsendable()
        while self._sent >= self._send_limit and not self._remote_finished:
            self._writable.clear()
            await self._writable.wait()
            self._raise_if_unsendable()

    def send_held(self, frame: Data) -> None:
        """Send ``frame`` deferred, now, without waiting for credit: for a ``before_flush``
        callback, which cannot wait. Its sender waited with ``wait_credit`` when it began
        gathering the frame, so the window is overshot by at most what one flush gathers (the
        reader allows a frame's worth). Raises like ``send``."""
        data = encode(frame)
        self._raise_if_unsendable()
        self._sent += len(data)
        self._host.stream_write(self.stream_id, data, False, True)

    def before_flush(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once, right before the connection next hands its held writes to
        aioquic (at most ``flush_delay`` from now): the moment a sender that gathers small
        pieces into one frame – a response's tokens into one event – sends it, with
        ``send_held``. One callback per stream: registering again replaces it. Dropped when
        the stream is reset or the connection lost."""
        self._host.stream_before_flush(self.stream_id, callback)

    async def recv(self) -> Frame | None:
        """Next frame, or ``None`` once the terminal frame (End / BodyEnd) was handed out.

        Raises ``IncompleteResponse`` if the peer finished before its terminal frame (EOF is
        never success), ``StreamReset`` if the peer reset it, ``ConnectionLost``, or
        ``ProtocolViolation``/``FrameError`` for a peer that breaks the frame protocol."""
        while True:
            if self._inbound:
                return self._take()
            if self._sequence.complete:
                return None  # the terminal frame was handed out: nothing more is expected
            if self._error is not None:
                raise self._error
            if self._remote_finished:
                self._sequence.check_eof()
                return None
            self._readable.clear()
            await self._readable.wait()

    async def recv_batch(self) -> list[Frame]:
        """Every frame that has arrived, waiting for one if none has; ``[]`` once the terminal
        frame was handed out. Raises like ``recv``. For readers of token streams, which get
        many frames per datagram: one wake-up for them all, not one per frame. Credit for the
        whole batch is returned at once, so a reader holds at most one window besides the
        stream's own."""
        first = await self.recv()
        if first is None or not self._inbound:
            return [] if first is None else [first]
        inbound, self._inbound = self._inbound, deque()
        frames = [first, *(frame for frame, _ in inbound)]
        self._consume(sum(size for _, size in inbound))
        if type(frames[-1]) is End and self.role is StreamRole.RESPONSE:
            self.finish()  # End is last: the sequence check lets nothing follow it
        return frames

    async def wait_broken(self) -> TunnelError | FrameError:
        """Wait until the stream breaks – the peer reset or stopped it, the connection died,
        the peer broke the protocol, or we reset it – and return that error (not raised).

        Unlike ``recv`` this also reports a reset after the terminal frame was read: a handler
        streaming its response races it against its work to stop when the requester left.
        Never returns for an exchange that completes normally."""
        await self._broken.wait()
        assert self._error is not None
        return self._error

    def finish(self) -> None:
        """Send the QUIC FIN: we will send nothing more. Idempotent."""
        if self._local_finished:
            return
        if self._host.lost_error() is None:
            # Nobody waits for a bare FIN (it only lets both ends forget the stream): it may
            # ride with the next datagram.
            self._host.stream_write(self.stream_id, b"", True, True)
        self._finish_local()

    def reset(self, code: int = ErrorCode.CANCELLED) -> None:
        """Abort both directions with ``code`` (the peer's reader gets ``StreamReset``)."""
        if self.done:
            return
        if self._host.lost_error() is None:
            self._host.stream_abort(
                self.stream_id, code, not self._local_finished, not self._remote_finished
            )
        if self._error is None:
            self._error = ClosedError(f"stream {self.stream_id} was reset locally")
        self._local_finished = self._remote_finished = True
        self._wake()
        self._host.stream_done(self.stream_id)

    async def aclose(self) -> None:
        """End of ``async with``: a completed exchange just finishes, anything else is reset
        with CANCELLED (the requester gave up, or a handler left without sending ``End``)."""
        if self.done:
            return
        if self.role is StreamRole.RESPONSE and self._sequence.complete:
            self.finish()
        elif self.role is StreamRole.REQUEST and self._local_finished and self._error is None:
            return  # End sent; the requester's FIN completes the stream
        else:
            self.reset(ErrorCode.CANCELLED)

    async def __aenter__(self) -> TunnelStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def read_body(self, limit: int) -> bytes | None:
        """A request's body: its ``Body`` frames up to ``BodyEnd``; None once it passes
        ``limit`` bytes (the caller refuses it). Raises like ``recv``."""
        body = bytearray()
        while True:
            frame = await self.recv()
            if isinstance(frame, Body):
                body += frame.data
                if len(body) > limit:
                    return None
            elif isinstance(frame, BodyEnd) or frame is None:
                return bytes(body)

    def __aiter__(self) -> AsyncIterator[Frame]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Frame]:
        while (frame := await self.recv()) is not None:
            yield frame

    def __repr__(self) -> str:
        return f"<TunnelStream {self.stream_id} {self.role.value} done={self.done}>"

    async def serve(
        self, handler: Callable[[TunnelStream], Awaitable[None]], where: object
    ) -> None:
        """Run the application's ``handler`` on this peer-opened stream (``where``: its
        connection, for the log). A failing handler is logged; one that leaves without sending
        ``End`` resets the stream, so the requester never waits for an answer that won't come."""
        try:
            await handler(self)
        except StreamLost as exc:
            log.debug("stream %d of %r lost: %s", self.stream_id, where, exc)
        except MeshError as exc:  # e.g. the peer broke the frame protocol
            log.warning("stream %d of %r: %s", self.stream_id, where, exc)
        except Exception:
            log.exception("stream handler failed on stream %d of %r", self.stream_id, where)
            self.reset(ErrorCode.INTERNAL)
        finally:
            if not self._local_finished:
                self.reset(ErrorCode.INTERNAL)  # the handler left without sending End

    # ---- called by the connection ----

    def data_received(self, data: bytes, end_stream: bool) -> None:
        if self._remote_finished:
            return
        try:
            for frame, size in self._decoder.feed_sized(data):
                if type(frame) is Window:
                    self._on_credit(frame.consumed)
                    continue
                self._sequence.accept(frame)
                self._received += size
                if self._local_finished:
                    if self.role is StreamRole.REQUEST:
                        continue  # End already sent: nobody reads the rest of this request
                elif self._received - self._consumed > self._window + _MAX_FRAME:
                    raise ProtocolViolation("peer ignored the stream's flow-control window")
                self._inbound.append((frame, size))
            if end_stream:
                self._decoder.check_eof()
        except FrameError as exc:  # includes ProtocolViolation
            log.warning("stream %d: peer broke the frame protocol: %s", self.stream_id, exc)
            self._error = exc if isinstance(exc, ProtocolViolation) else ProtocolViolation(str(exc))
            self.reset(ErrorCode.PROTOCOL)
            return
        if end_stream:
            self._remote_finished = True
            self._writable.set()  # the peer cannot return credit any more
            self._check_done()
        self._wake()

    def reset_received(self, code: int) -> None:
        """The peer reset its sending side."""
        if self._remote_finished:
            return
        self._remote_finished = True
        if self._error is None:
            self._error = StreamReset(
                f"peer reset stream {self.stream_id}: {error_name(code)}", code
            )
        self._wake()
        self._check_done()

    def stop_sending_received(self, code: int) -> None:
        """The peer no longer reads: aioquic already reset our sending side."""
        if self._local_finished:
            return
        self._local_finished = True
        if self._error is None:
            self._error = StreamReset(
                f"peer stopped stream {self.stream_id}: {error_name(code)}", code
            )
        self._wake()
        self._check_done()

    def connection_lost(self, error: ConnectionLost) -> None:
        if self.done:
            return
        if self._error is None or isinstance(self._error, ClosedError):
            self._error = error
        self._local_finished = self._remote_finished = True
        self._wake()

    # ---- internals ----

    def _raise_if_unsendable(self) -> None:
        lost = self._host.lost_error()
        if lost is not None:
            raise lost
        if self._local_finished:
            if isinstance(self._error, StreamReset):
                raise self._error
            raise ClosedError(f"stream {self.stream_id} already finished sending")

    def _on_credit(self, consumed: int) -> None:
        limit = consumed + self._window
        if limit > self._send_limit:
            self._send_limit = limit
            self._writable.set()

    def _take(self) -> Frame:
        frame, size = self._inbound.popleft()
        self._consume(size)
        if type(frame) is End and self.role is StreamRole.RESPONSE:
            self.finish()
        return frame

    def _consume(self, size: int) -> None:
        self._consumed += size
        if (
            not self._local_finished
            and not self._remote_finished
            and self._consumed - self._advertised >= self._window // 2
        ):
            self._advertised = self._consumed
            self._host.stream_write(self.stream_id, encode(Window(self._consumed)), False)

    def _finish_local(self) -> None:
        self._local_finished = True
        self._check_done()

    def _check_done(self) -> None:
        if self.done:
            self._host.stream_done(self.stream_id)

    def _wake(self) -> None:
        self._readable.set()
        self._writable.set()
        if self._error is not None:
            self._broken.set()
