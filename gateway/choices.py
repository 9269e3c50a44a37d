"""Several answers to one request (Chat ``n > 1``): one upstream call per choice, merged.

Each choice is a request of its own through the router (its own retry, its own route), so an
upstream needs nothing new: the worker's engine sees ``n`` jobs with one prompt arrive together
and prefills it once (worker/engine/shared_prefill.py). Choice ``i`` with a ``seed`` samples with
``seed + i``, so choice 0 is what a single request with that seed says and the others differ.

:func:`fan_out` runs the calls and yields each one's events wrapped in ``ChoiceEvent(index, …)``
as they arrive, route ``Meta`` unwrapped; when every choice has ended, the usage of the whole
request (:func:`merged_usage`) and one plain ``Done``. The first choice that fails fails the
request: its ``Error`` is the terminal event and the other calls are closed. Closing the stream
(a client that went away) closes every call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from gateway.events import ChoiceEvent, Done, Error, Event, Meta, Usage
from gateway.request import INT64_MAX, ChatRequest
from gateway.upstream import close_stream

log = logging.getLogger(__name__)

MAX_CHOICES = 16  # one engine batch holds them all (EngineConfig.completion_batch_size)


def choice_request(request: ChatRequest, index: int) -> ChatRequest:
    """The request for choice ``index``: the caller's, its seed moved on by ``index``."""
    if index == 0 or request.seed is None:
        return request
    seed = request.seed + index if request.seed <= INT64_MAX - index else request.seed - index
    return request.model_copy(update={"seed": seed})


def merged_usage(usages: Sequence[Usage]) -> Usage:
    """OpenAI's usage for several choices: the prompt counted once, completions summed. The
    prompt's cached tokens are the least any choice read: the others' came from the first
    one's prefill, not from an earlier request."""
    if not usages:
        return Usage(0, 0)
    return Usage(
        prompt_tokens=max(u.prompt_tokens for u in usages),
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=min(u.cached_tokens for u in usages),
    )


@dataclass
class ChoiceMerger:
    """The merge of several choices' events, fed them as they arrive (``None``: that choice's
    stream ended). Pure: :func:`fan_out` is its asyncio adapter."""

    n: int
    usages: dict[int, Usage] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    ended: set[int] = field(default_factory=set)
    over: bool = False  # the terminal event was given out

    def feed(self, index: int, event: Event | None) -> list[Event]:
        """What the merged stream says now."""
        if self.over:
            return []
        if event is None:
            self.ended.add(index)
            if index not in self.finished:
                return self._end(Error(kind="upstream", message=f"choice {index} broke off"))
            if len(self.ended) < self.n:
                return []
            return self._end(merged_usage([self.usages[i] for i in sorted(self.usages)]), Done())
        if isinstance(event, Meta):
            return [event]
        if isinstance(event, Error):
            return self._end(event)
        if isinstance(event, Usage):
            self.usages[index] = event
        elif isinstance(event, Done):
            self.finished.add(index)
        return [ChoiceEvent(index, event)]

    def _end(self, *events: Event) -> list[Event]:
        self.over = True
        return list(events)


async def fan_out(
    request: ChatRequest, n: int, open_stream: Callable[[ChatRequest], AsyncIterator[Event]]
) -> AsyncIterator[Event]:
    """The merged events of ``n`` choices of ``request`` (see the module docstring)."""
    queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()
    streams = [open_stream(choice_request(request, i)) for i in range(n)]
    tasks = [
        asyncio.create_task(_pump(i, s, queue), name=f"gateway-choice-{i}")
        for i, s in enumerate(streams)
    ]
    merger = ChoiceMerger(n)
    try:
        while not merger.over:
            for event in merger.feed(*await queue.get()):
                yield event
    finally:
        # Each pump closes its own stream: this cleanup may itself be cancelled (the exchange
        # cancels its producer once the answer is out), and a stream must be closed by the task
        # that iterates it, never from here while it runs.
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)


async def _pump(
    index: int, source: AsyncIterator[Event], queue: asyncio.Queue[tuple[int, Event | None]]
) -> None:
    try:
        async for event in source:
            queue.put_nowait((index, event))
            if isinstance(event, Done | Error):
                return
    except Exception as exc:  # the request fails with it, as a single call's would
        log.warning("choice %d failed: %r", index, exc, exc_info=exc)
        message = f"upstream failed: {type(exc).__name__}: {exc}"
        queue.put_nowait((index, Error(kind="internal", message=message)))
    finally:
        queue.put_nowait((index, None))  # ended (a stream without a terminal included)
        await close_stream(source)
