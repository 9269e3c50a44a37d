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

from gateway.events import Done, Error, Event

log = logging.getLogger(__name__)


class ProducerStream:
    """Events of one upstream call, read with :meth:`get`; always ends with a terminal event."""

    def __init__(self, source: AsyncIterator[Event]) -> None:
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._terminal_queued = False
        self._task = asyncio.create_task(self._pump(source), name="gateway-producer")
        self._task.add_done_callback(self._on_producer_done)

    async def _pump(self, source: AsyncIterator[Event]) -> None:
        closer = getattr(source, "aclose", None)
        try:
            async for event in source:
                self._queue.put_nowait(event)
                if isinstance(event, Done | Error):
                    self._terminal_queued = True
                    return
        finally:
            if closer is not None:
                await closer()

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

    async def get(self, wait_s: float | None = None) -> Event | None:
        """The next event, or ``None`` when ``wait_s`` seconds pass without one."""
        queue = self._queue
        if not queue.empty():
            return queue.get_nowait()
        if wait_s is None:
            return await queue.get()
        try:
            async with asyncio.timeout(wait_s):
                return await queue.get()
        except TimeoutError:
            return None

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
        task = self._task
        if not task.done():
            task.cancel()
            # wait() never raises the task's own outcome; the done-callback already reported it.
            await asyncio.wait([task])

    @property
    def finished(self) -> bool:
        return self._task.done()


__all__ = ["Done", "Error", "ProducerStream"]
