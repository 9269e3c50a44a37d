"""Listening sockets for our HTTP servers (worker, gateway, test servers), and how a node hands
its worker the secret that guards the worker's port."""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

# The environment variable that carries a node-started worker's secret (see worker/serve/app.py).
SECRET_ENV = "MLX_MESH_WORKER_SECRET"


def bind_socket(host: str, port: int, backlog: int = 512) -> socket.socket:
    """A listening socket (port 0 picks a free one) so the URL is known before serving.

    proto must say TCP: asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP,
    and without it every stream's first frame waits ~40 ms for the client's delayed ACK.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


# -- every socket has a deadline ------------------------------------------------------------------

HEADER_TIMEOUT_S = 10.0  # from a request's first byte to the end of its headers
BODY_TIMEOUT_S = 60.0  # from the end of the headers to the end of the body
KEEP_ALIVE_S = 5.0  # an idle kept-alive connection is closed after this
OPEN_FILES_SPARE = 64  # descriptors kept free for logs, models, sockets to peers and workers


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines: a client that sends its headers (or its body)
    a byte at a time is closed instead of holding a connection forever. uvicorn's keep-alive
    timer is cancelled by every byte that arrives, so it cannot catch such a client alone.

    A WebSocket upgrade hands the transport to another protocol mid-request (the upgrade
    request's "body" never ends): from then on the deadlines are not ours to keep, and one left
    armed would drop every socket ``body_timeout_s`` after its upgrade, without a close frame.
    The WebSocket side keeps its own limits (pings; gateway.responses.websocket)."""

    header_timeout_s = HEADER_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._reading: object = None  # the h11 state the deadline guards
        self._upgraded = False
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._arm()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._upgraded = True
        self._disarm()
        super().handle_websocket_upgrade(event)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()  # the next request's deadline starts with its first byte

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        state = self.conn.their_state
        if state is self._reading or self._upgraded:
            return
        self._disarm()
        if state is h11.IDLE:
            self._set(state, self.header_timeout_s, "request headers")
        elif state is h11.SEND_BODY:
            self._set(state, self.body_timeout_s, "request body")

    def _set(self, state: object, seconds: float, what: str) -> None:
        self._reading = state
        self._deadline = self.loop.call_later(seconds, self._too_slow, what, seconds)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._reading = None, None

    def _too_slow(self, what: str, seconds: float) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            log.info("closing %s: its %s took over %.0fs", self.client, what, seconds)
            self.transport.close()


def raise_open_files_limit() -> int:
    """Raise the soft open-files limit to the hard one (macOS starts processes at 256, which
    300 idle clients exhaust) and return how many concurrent connections to allow below it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if sys.platform == "darwin":
        target = min(target, 10240)  # OPEN_MAX: macOS refuses more for setrlimit
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d: %s", soft, exc)
    return max(16, soft - OPEN_FILES_SPARE)


class RepeatedLogFilter(logging.Filter):
    """Lets a message through at most once per ``every_s`` (with a count of those held back):
    a flood of identical errors (e.g. accept() failing at the descriptor limit) must not fill
    the disk with tracebacks."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every_s = every_s
        self.clock = clock
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = self.clock()
        seen = self._last.get(key)
        if seen is not None and now - seen[0] < self.every_s:
            self._last[key] = (seen[0], seen[1] + 1)
            return False
        held = seen[1] if seen is not None else 0
        self._last[key] = (now, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like it in the last {self.every_s:.0f}s)"
        return True


def configure_logging(level: int = logging.WARNING) -> None:
    """One line per record on stderr, and no floods of identical lines. A process whose logging
    someone else set up already (a test runner calling the CLI in-process) keeps its handlers as
    they are: a filter added to them held back later tests' lines."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RepeatedLogFilter())
    root.addHandler(handler)
    root.setLevel(level)


def server_limits() -> dict[str, Any]:
    """uvicorn settings every one of our servers uses: read deadlines, idle keep-alive and a
    connection cap below the open-files limit (then 503 instead of failing accept())."""
    return {
        "http": DeadlineH11Protocol,
        "timeout_keep_alive": KEEP_ALIVE_S,
        "limit_concurrency": raise_open_files_limit(),
        # WebSockets (the gateway's Responses WebSocket mode): a message is at most a request
        # body's size, and a peer that stops answering pings is closed within 40 s.
        "ws_max_size": 8 * 1024 * 1024,
        "ws_ping_interval": 20.0,
        "ws_ping_timeout": 20.0,
    }
