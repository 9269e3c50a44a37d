"""The web console: the page at ``/``, its static files, and the live feeds it reads.

Routes (see :func:`console_routes`):

- ``GET /`` – the single-page console (``gateway/static/index.html``).
- ``GET /static/*`` – its script and style sheet.
- ``GET /api/events`` – Server-Sent Events: ``status`` (the mesh picture, sent on connect and
  whenever it changes), ``request`` (one per finished request from the request log) and
  ``heartbeat`` (every few seconds, so the page can tell a dead gateway from a quiet one).
- ``GET /api/requests`` – the recent requests as JSON (the table's initial fill).

The feed logic is a pure object (:class:`ConsoleFeed`: snapshots and clocks in, SSE frames out);
the route only polls its sources and writes what the feed returns. Starlette cancels the
generator when the client goes away, which ends the poll loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from gateway.sse import encoded_frame, named_frame
from gateway.status import StatusSource, read_status
from gateway.upstream import ModelDirectory

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).with_name("static")


class RecentRequests:
    """A bounded ring buffer of finished requests, numbered so that readers can ask for news.

    The gateway calls :meth:`record` once per request (after the response); the console reads
    :meth:`since` / :meth:`rows`. Rows are plain dicts (or dataclasses, converted on the way in)
    with any of: ``api, model, route, peer, attempts, ttft_ms, tok_s, outcome, status, at``.
    """

    def __init__(self, maxlen: int = 200) -> None:
        self._rows: deque[tuple[int, dict[str, Any]]] = deque(maxlen=maxlen)
        self._counter = itertools.count(1)
        self._last_seq = 0

    def record(self, row: Mapping[str, Any] | Any) -> None:
        if isinstance(row, Mapping):
            data = dict(row)
        else:  # a dataclass record, e.g. metrics' RequestRecord
            data = dataclasses.asdict(row)
        self._last_seq = next(self._counter)
        self._rows.append((self._last_seq, console_row(data)))

    @property
    def last_seq(self) -> int:
        return self._last_seq

    def since(self, seq: int) -> list[tuple[int, dict[str, Any]]]:
        """Rows recorded after ``seq``, oldest first (rows already evicted are gone)."""
        return [(s, row) for s, row in self._rows if s > seq]

    def rows(self) -> list[dict[str, Any]]:
        return [row for _, row in self._rows]


def console_row(data: dict[str, Any]) -> dict[str, Any]:
    """Flatten a request-log row (``gateway.metrics.RequestRecord`` as a dict, or any dict) into
    the table's columns: route/peer/attempts/winner out of the route headers, TTFT in ms, tok/s."""
    row = dict(data)
    route = row.get("route")
    if isinstance(route, Mapping):
        row["route"] = route.get("x-route") or route.get("route") or route.get("kind")
        for key in ("peer", "attempts", "moa-winner", "mesh-route-reason", "mesh-hedge"):
            value = route.get(f"x-{key}", route.get(key))
            if value is not None:
                row.setdefault(key.replace("-", "_"), value)
    row.setdefault("at", row.get("started", time.time()))
    ttft_s = row.get("ttft_s")
    if row.get("ttft_ms") is None and isinstance(ttft_s, int | float):
        row["ttft_ms"] = round(ttft_s * 1000, 1)
    tokens, duration = row.get("completion_tokens"), row.get("duration_s")
    if row.get("tok_s") is None and isinstance(tokens, int) and isinstance(duration, int | float):
        decode_s = duration - (ttft_s if isinstance(ttft_s, int | float) else 0.0)
        if tokens > 1 and decode_s > 0:
            row["tok_s"] = round(tokens / decode_s, 1)
    return row


class ConsoleFeed:
    """Decides what to send on ``/api/events``: pure, fed snapshots and the current time."""

    def __init__(self, heartbeat_s: float = 5.0, request_seq: int = 0) -> None:
        self.heartbeat_s = heartbeat_s
        self.request_seq = request_seq
        self._last_status: bytes | None = None
        self._last_sent = float("-inf")

    def status_changes(self, status: Mapping[str, Any]) -> bool:
        """Whether ``status`` differs from the last one sent."""
        return orjson.dumps(status, option=orjson.OPT_SORT_KEYS) != self._last_status

    def step(
        self,
        now: float,
        status: Mapping[str, Any] | None,
        new_requests: Sequence[tuple[int, dict[str, Any]]] = (),
    ) -> list[bytes]:
        frames: list[bytes] = []
        if status is not None:
            encoded = orjson.dumps(status, option=orjson.OPT_SORT_KEYS)
            if encoded != self._last_status:
                self._last_status = encoded
                frames.append(encoded_frame("status", encoded))
        for seq, row in new_requests:
            if seq > self.request_seq:
                self.request_seq = seq
                frames.append(named_frame("request", row))
        if frames:
            self._last_sent = now
        elif now - self._last_sent >= self.heartbeat_s:
            self._last_sent = now
            frames.append(named_frame("heartbeat", {}))
        return frames


def close_event_streams(app: Any) -> None:
    """End every open ``/api/events`` stream within one poll: call when the server starts to
    shut down, or open consoles hold up uvicorn's graceful shutdown until its timeout."""
    app.state.console_closing = True


def console_routes(
    status_provider: StatusSource | None = None,
    *,
    directory: ModelDirectory | None = None,
    requests: RecentRequests | None = None,
    poll_s: float = 0.5,
    heartbeat_s: float = 5.0,
) -> list[BaseRoute]:
    """The console's routes, to be added to the gateway's route list.

    ``status_provider`` returns the mesh picture (see :mod:`gateway.status`); ``directory``
    fills in this node's models when the source does not say; :func:`gateway.app.create_app`
    passes its own. ``requests`` is the gateway's recent-request buffer.
    """

    async def index(request: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers={"cache-control": "no-store"})

    async def recent_requests(request: Request) -> Response:
        rows = requests.rows() if requests is not None else []
        return JSONResponse({"requests": rows})

    async def events(request: Request) -> Response:
        def closing() -> bool:
            return getattr(request.app.state, "console_closing", False)

        return StreamingResponse(
            _event_stream(status_provider, directory, requests, poll_s, heartbeat_s, closing),
            media_type="text/event-stream",
            headers={"cache-control": "no-store", "x-accel-buffering": "no"},
        )

    return [
        Route("/", index, methods=["GET"]),
        Route("/api/events", events, methods=["GET"]),
        Route("/api/requests", recent_requests, methods=["GET"]),
        Mount("/static", app=StaticFiles(directory=STATIC_DIR), name="console-static"),
    ]


async def _event_stream(
    status_provider: StatusSource | None,
    directory: ModelDirectory | None,
    requests: RecentRequests | None,
    poll_s: float,
    heartbeat_s: float,
    closing: Callable[[], bool],
) -> AsyncIterator[bytes]:
    # Start from "now" in the request log: the page fetches history from /api/requests.
    feed = ConsoleFeed(heartbeat_s, request_seq=requests.last_seq if requests else 0)
    yield b"retry: 2000\n\n"
    while not closing():
        try:
            status = await read_status(status_provider, directory)
        except Exception as exc:
            # A broken status source must not kill the feed: show it on the page, log it once.
            status = {"error": f"status unavailable: {exc}"}
            if feed.status_changes(status):
                log.warning("console status provider failed", exc_info=exc)
        news = requests.since(feed.request_seq) if requests is not None else []
        for frame in feed.step(time.monotonic(), status, news):
            yield frame
        await asyncio.sleep(poll_s)
