"""A hedged first token: one request on two upstreams, the first to commit wins.

:class:`HedgedUpstream` runs a request on ``primary``; when no content has come after
``delay_s`` (and ``allow()`` still says yes: the mesh is not overloaded) it starts the same
request on ``backup`` too. Whichever commits first (its first content delta, or its terminal)
is passed on, the other is closed at once, so nothing decodes for nobody. Never after the
commit, and at most one hedge per request: the instance remembers it hedged, so a retry of
the same route does not hedge again. A retryable failure of one side before the commit waits
for the other; of both (or of the only one), the last failure is passed on for the router to
retry. The winner's facts go out in a ``Meta`` (``x-mesh-hedge: won|lost`` – whether the
hedge won – and the winner's ``x-route``/``x-peer``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from gateway.events import Done, Error, Event, Meta
from gateway.request import ChatRequest
from gateway.router import CommitTracker
from gateway.upstream import Upstream, close_stream

HEDGE_HEADER = "x-mesh-hedge"
_END = object()  # a side's stream ended


@dataclass
class _Side:
    index: int
    upstream: Upstream
    headers: dict[str, str]
    commit: CommitTracker
    held: list[Event] = field(default_factory=list)
    task: asyncio.Task | None = None
    failed: Error | None = None


@dataclass
class HedgedUpstream(Upstream):
    """``headers``: the route headers of each side, sent when it wins a started hedge."""

    primary: Upstream
    backup: Upstream
    delay_s: float
    headers: tuple[dict[str, str], dict[str, str]] = ({}, {})
    allow: Callable[[], bool] = lambda: True
    on_hedge: Callable[[str], None] | None = None  # "started", then "won" or "lost"
    hedged: bool = False

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.primary.name

    async def aclose(self) -> None:
        """Nothing of its own: both upstreams belong to whoever made them."""

    async def stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        sides = [
            _Side(0, self.primary, self.headers[0], CommitTracker(streaming=request.stream)),
            _Side(1, self.backup, self.headers[1], CommitTracker(streaming=request.stream)),
        ]
        try:
            winner = await self._race(sides, request, queue)
            if isinstance(winner, Error):
                yield winner
                return
            for other in sides:
                if other is not winner:
                    await _stop(other)
            if self.hedged:
                self._note("won" if winner.index == 1 else "lost")
                yield Meta(winner.headers | {HEDGE_HEADER: "won" if winner.index else "lost"})
            for event in winner.held:
                yield event
            if isinstance(winner.held[-1], Done | Error):
                return
            async for event in _follow(winner, queue):
                yield event
        finally:
            for side in sides:
                await _stop(side)

    async def _race(self, sides: list[_Side], request: ChatRequest, queue: asyncio.Queue) -> _Side | Error:  # fmt: skip
        """The side that commits first, hedging once after the delay; or the last failure."""
        self._start(sides[0], request, queue)
        loop = asyncio.get_running_loop()
        deadline: float | None = None if self.hedged else loop.time() + self.delay_s
        while True:
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                index, item = await asyncio.wait_for(queue.get(), timeout)
            except TimeoutError:
                deadline = None
                if self.allow():
                    self.hedged = True
                    self._note("started")
                    self._start(sides[1], request, queue)
                continue
            outcome = self._before_commit(sides[index], item, sides)
            if isinstance(outcome, Error):
                return outcome
            if outcome:
                return sides[index]

    def _before_commit(self, side: _Side, item: object, sides: list[_Side]) -> bool | Error:
        """True when ``item`` commits ``side``; an Error when the request failed everywhere."""
        if item is _END or (isinstance(item, Error) and side.commit.may_retry(item)):
            side.failed = (
                item
                if isinstance(item, Error)
                else Error(
                    kind="upstream", message="upstream ended before answering", retryable=True
                )
            )
            if any(s.task is not None and s.failed is None for s in sides):
                return False  # the other side may still answer
            return side.failed
        assert isinstance(item, Event)
        side.held.append(item)
        return side.commit.feed(item)

    def _start(self, side: _Side, request: ChatRequest, queue: asyncio.Queue) -> None:
        side.task = asyncio.create_task(_pump(side, request, queue))

    def _note(self, what: str) -> None:
        if self.on_hedge is not None:
            self.on_hedge(what)


async def _follow(winner: _Side, queue: asyncio.Queue) -> AsyncIterator[Event]:
    """The committed side's events, to its terminal."""
    while True:
        index, item = await queue.get()
        if index != winner.index:
            continue
        if item is _END:
            yield Error(kind="upstream", message="upstream ended without a terminal event")
            return
        assert isinstance(item, Event)
        yield item
        if isinstance(item, Done | Error):
            return


async def _pump(side: _Side, request: ChatRequest, queue: asyncio.Queue) -> None:
    source = side.upstream.stream(request)
    try:
        async for event in source:
            queue.put_nowait((side.index, event))
    except Exception as exc:  # a broken upstream: a failure like any other, before the commit
        lost = Error(kind="unavailable", message=f"upstream failed: {exc}", retryable=True)
        queue.put_nowait((side.index, lost))
    finally:
        queue.put_nowait((side.index, _END))
        await close_stream(source)


async def _stop(side: _Side) -> None:
    """Cancel a side's pump now (its stream closes, so the upstream stops generating)."""
    if side.task is not None and not side.task.done():
        side.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await side.task
