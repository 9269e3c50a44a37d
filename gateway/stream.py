"""Run an upstream as a producer task that feeds a queue the response writer reads.

The guarantee every API relies on: the reader always gets exactly one terminal event
(``Done`` or ``Error``). The producer task's completion – normal end, exception or
cancellation – is observed by a done-callback that enqueues a terminal event when the upstream
did not send one, so the reader never waits forever. ``aclose()`` cancels the producer and waits
for it, so no task outlives the request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import overload

from gateway.events import Done, Error, Event
from gateway.upstream import close_stream

log = logging.getLogger(__name__)

_IDLE = object()  # queued by the idle ticker: "nothing happened for idle_s"


class ProducerStream:
    """Events of one upstream call, read with :meth:`get`; always ends with a terminal event."""

    def __init__(self, source: AsyncIterator[Event]) -> None:
        self._queue: asyncio.Queue[Event | object] = asyncio.Queue()
        self._terminal_queued = False
        self._loop = asyncio.get_running_loop()
        self._last_put = self._loop.time()
        self._idle_s = 0.0
        self._ticker: asyncio.TimerHandle | None = None
        self._task = asyncio.create_task(self._pump(source), name="gateway-producer")
        self._task.add_done_callback(self._on_producer_done)

    async def _pump(self, source: AsyncIterator[Event]) -> None:
        try:
            async for event in source:
                self._queue.put_nowait(event)
                self._last_put = self._loop.time()
                if isinstance(event, Done | Error):
                    self._terminal_queued = True
                    return
        finally:
            await close_stream(source)

    def _on_producer_done(self, task: asyncio.Task[None]) -> None:
        if self._terminal_queued:
            return
        self._terminal_queued = True
        if task.cancelled():
            terminal: Event = Error(kind="cancelled", message="the request was cancelled")
        elif (exc := task.exception()) is not None:
            log.warning("upstream failed: %r", exc, exc_info=exc)
            terminal = Error(
                kind="internal", message=f"upstream failed: {type(exc).__name__}: {exc}"
            )
        else:
            terminal = Error(kind="upstream", message="upstream ended without a terminal event")
        self._queue.put_nowait(terminal)

    @overload
    async def get(self) -> Event: ...
    @overload
    async def get(self, wait_s: float | None) -> Event | None: ...
    async def get(self, wait_s: float | None = None) -> Event | None:
        """The next event, or ``None`` when ``wait_s`` seconds pass without one."""
        queue = self._queue
        if not queue.empty():
            event = queue.get_nowait()
        elif wait_s is None:
            event = await queue.get()
        else:
            try:
                async with asyncio.timeout(wait_s):
                    event = await queue.get()
            except TimeoutError:
                return None
        return None if event is _IDLE else event  # type: ignore[return-value]

    async def next_or_idle(self, idle_s: float) -> Event | None:
        """The next event, or ``None`` when none came for ``idle_s`` (time for a keep-alive).

        One re-armed timer per stream instead of a timeout per call: per-token cost matters.
        """
        if self._ticker is None:
            self._idle_s = idle_s
            self._last_put = self._loop.time()
            self._ticker = self._loop.call_later(idle_s, self._tick)
        event = await self._queue.get()
        return None if event is _IDLE else event  # type: ignore[return-value]

    def _tick(self) -> None:
        idle_for = self._loop.time() - self._last_put
        if idle_for >= self._idle_s * 0.99:
            self._queue.put_nowait(_IDLE)
            self._last_put = self._loop.time()
            self._ticker = self._loop.call_later(self._idle_s, self._tick)
        else:
            self._ticker = self._loop.call_later(self._idle_s - idle_for, self._tick)

    def ready(self) -> list[Event]:
        """Every event already queued, without waiting (to coalesce frames into one write)."""
        queue = self._queue
        if queue.empty():
            return []
        events = [queue.get_nowait() for _ in range(queue.qsize())]
        return [e for e in events if e is not _IDLE]  # type: ignore[misc]

    async def collect(self) -> list[Event]:
        """Every event up to and including the terminal one (non-streaming responses)."""
        events: list[Event] = []
        while True:
            event = await self.get()
            assert event is not None
            events.append(event)
            if isinstance(event, Done | Error):
                return events

    async def aclose(self) -> None:
        """Cancel the producer (client gone or response finished) and wait until it has ended."""
        if self._ticker is not None:
            self._ticker.cancel()
        task = self._task
        if not task.done():
            task.cancel()
            # wait() never raises the task's own outcome; the done-callback already reported it.
            await asyncio.wait([task])

    @property
    def finished(self) -> bool:
        return self._task.done()
