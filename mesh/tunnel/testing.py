"""In-memory tunnel streams: a test double for code that reads and writes ``TunnelStream``.

Both halves are real ``TunnelStream`` objects (the same frame checks, credit window and error
surfacing as over QUIC); only the QUIC connection is replaced by the event loop. Bytes written
by one half reach the other on the next loop iteration, like a network would deliver them::

    pipe = StreamPipe()
    requester, responder = pipe.requester, pipe.responder
    await requester.send(RequestHead(id="1", path="/x"))
    assert isinstance(await responder.recv(), RequestHead)
    pipe.lose()          # both halves get ConnectionLost, as if the connection died
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from mesh.errors import ConnectionLost
from mesh.tunnel.frames import StreamRole
from mesh.tunnel.stream import TunnelStream

DEFAULT_WINDOW = 256 * 1024


class PipeHost:
    """One side of an in-memory stream pair (the ``StreamHost`` a PeerConnection would be)."""

    def __init__(self) -> None:
        self.peer: TunnelStream | None = None
        self.lost: ConnectionLost | None = None
        self.done = False
        self.written = 0  # bytes written, Window frames included

    def stream_write(
        self, stream_id: int, data: bytes, end_stream: bool, defer: bool = False
    ) -> None:
        self.written += len(data)
        peer = self.peer
        if peer is not None:
            asyncio.get_running_loop().call_soon(peer.data_received, data, end_stream)

    def stream_before_flush(self, stream_id: int, callback: Callable[[], None]) -> None:
        # No datagrams to fill here: the "flush" is the next loop iteration.
        asyncio.get_running_loop().call_soon(callback)

    def stream_abort(self, stream_id: int, code: int, send: bool, receive: bool) -> None:
        peer = self.peer
        if peer is None:
            return
        loop = asyncio.get_running_loop()
        if send:
            loop.call_soon(peer.reset_received, code)
        if receive:
            loop.call_soon(peer.stop_sending_received, code)

    def stream_done(self, stream_id: int) -> None:
        self.done = True

    def lost_error(self) -> ConnectionLost | None:
        return self.lost


class StreamPipe:
    """A requester half (role RESPONSE) wired to a responder half (role REQUEST)."""

    def __init__(self, window: int = DEFAULT_WINDOW, stream_id: int = 4) -> None:
        self.requester_host, self.responder_host = PipeHost(), PipeHost()
        self.requester = TunnelStream(self.requester_host, stream_id, StreamRole.RESPONSE, window)
        self.responder = TunnelStream(self.responder_host, stream_id, StreamRole.REQUEST, window)
        self.requester_host.peer = self.responder
        self.responder_host.peer = self.requester

    def lose(self, message: str = "connection lost") -> None:
        """The connection dies under both halves (a killed peer, a ping timeout)."""
        for host, stream in (
            (self.requester_host, self.requester),
            (self.responder_host, self.responder),
        ):
            host.lost = ConnectionLost(message)
            stream.connection_lost(host.lost)
