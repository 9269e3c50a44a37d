"""Pick routes for a model and run one request across them, retrying before the commit point.

The commit point is the first content delta (or terminal); an early ``Usage`` or ``Sampling``
waits for it, and a ``Progress`` note passes through without committing (it is not part of the answer). A
failure before it – an ``Error`` that is retryable or of kind overloaded/unavailable (for a
client waiting for the whole answer also the upstream's own, upstream/timeout: then 503), an
exception, or a stream that ends early – is retried once on the same route after
``retry_backoff_s``, then on the next route (the MoA route is not retried: its arbiter already
deals with failing workers). After it, nothing is retried: the error goes on to
the client. Every routed stream starts with a ``Meta`` event carrying ``x-route``, ``x-peer``
and ``x-attempts``, merged with the upstream's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from gateway.errors import GatewayError
from gateway.events import RETRYABLE_KINDS, Done, Error, Event, Meta, Progress, Sampling, Usage
from gateway.request import ChatRequest
from gateway.upstream import MESH_MODEL, ModelDirectory, Route, Upstream, close_stream

log = logging.getLogger(__name__)

ROUTE_REASON_HEADER = "x-mesh-route-reason"
# The upstream's own failures (not the request's fault): worth another route while unanswered.
_BROKE_MID_ANSWER = frozenset({"upstream", "timeout"})


class RouteError(GatewayError):
    """No route for the request: carries the ``Error`` to answer with (404 or 503)."""

    def __init__(self, error: Error) -> None:
        super().__init__(error.message)
        self.error = error


def is_retryable(error: Error) -> bool:
    return error.retryable or error.kind in RETRYABLE_KINDS


@dataclass
class CommitTracker:
    """The commit point of one attempt, fed its events in order. Pure.

    Before the commit a failure may be retried; after it, never: the client has part of an
    answer. For a streamed answer the first content event commits – a delta, or a terminal.
    ``Meta`` (route facts), an early ``Usage`` (a prompt count), ``Sampling`` and a ``Progress``
    note do not: they are not the answer. A client that did not ask for a stream sees nothing
    until the answer is whole, so there only the terminal commits and a failure mid-answer may
    still be retried (the partial answer is thrown away).
    """

    streaming: bool = True
    committed: bool = False

    def feed(self, event: Event) -> bool:
        """Record ``event``; True when it is the one that commits."""
        if self.committed or isinstance(event, Meta | Usage | Sampling | Progress):
            return False
        if not self.streaming and not isinstance(event, Done | Error):
            return False
        self.committed = True
        return True

    def may_retry(self, error: Error) -> bool:
        """Whether ``error``, arriving now, may be retried elsewhere instead of answered."""
        return not self.committed and is_retryable(self.failure(error))

    def seen(self, event: Event) -> Event:
        """``event`` as this client must see it: an error as :meth:`failure` says."""
        return self.failure(event) if isinstance(event, Error) else event

    def failure(self, error: Error) -> Error:
        """``error`` as the client must see it: never retryable after the commit. Before it, a
        client waiting for the whole answer has seen nothing of one its upstream broke off
        mid-way (a worker killed, or silent past its deadline): the work is lost, not the
        request, so that is ``unavailable`` – retried elsewhere, else 503 with Retry-After."""
        if self.committed:
            return Error(kind="upstream", message=error.message, retryable=False)
        if not self.streaming and error.kind in _BROKE_MID_ANSWER and not is_retryable(error):
            return Error(kind="unavailable", message=error.message, retryable=True)
        return error


class Router:
    def __init__(
        self,
        directory: ModelDirectory,
        *,
        moa: Upstream | None = None,
        retry_backoff_s: float = 0.75,
    ):
        self.directory = directory
        self.moa = moa
        self.retry_backoff_s = retry_backoff_s

    def model_ids(self) -> list[str]:
        ids = [info.id for info in self.directory.models()]
        if self.moa is not None and MESH_MODEL not in ids:
            ids.append(MESH_MODEL)
        return ids

    def resolve(self, request: ChatRequest) -> list[Route]:
        """Candidate routes, best first; raises :class:`RouteError` for unknown/unreachable."""
        if request.model == MESH_MODEL and self.moa is not None:
            return [Route(upstream=self.moa, kind="moa")]
        routes = self.directory.routes(request.model, request.session_key)
        if routes:
            return routes
        known = self.model_ids()
        if request.model in known or self.directory.recently_served(request.model):
            raise RouteError(
                Error(
                    kind="unavailable",
                    message=f"no reachable node serves {request.model!r} right now",
                    retryable=True,
                )
            )
        raise RouteError(
            Error(
                kind="not_found",
                message=f"model {request.model!r} not found; available: {', '.join(known) or 'none'}",
                code="model_not_found",
                details={"available": known},
            )
        )

    async def aresolve(self, request: ChatRequest) -> list[Route]:
        """As :meth:`resolve`, but a directory that ranks routes by the prompt itself (the
        mesh's, by cached prefix: it may ask a worker to tokenize) gets to do so."""
        ranker = getattr(self.directory, "aroutes", None)
        if ranker is not None and not (request.model == MESH_MODEL and self.moa is not None):
            routes = await ranker(request)
            if routes:
                return routes
        return self.resolve(request)

    async def stream(
        self, request: ChatRequest, routes: list[Route]
    ) -> AsyncGenerator[Event, None]:
        """Run ``request`` over ``routes`` with retry-before-commit; always ends with a terminal."""
        plan = _plan(routes)
        reasons: list[str] = []
        last_error: Error | None = None
        for number, route in enumerate(plan, start=1):
            if number > 1 and route is plan[number - 2]:
                await asyncio.sleep(self.retry_backoff_s)
            attempt = _Attempt(route, number, reasons, last=number == len(plan))
            # aclosing: when this stream is closed at a yield, the attempt (and its upstream
            # call) is closed then and there, not whenever the garbage collector gets to it.
            async with contextlib.aclosing(attempt.run(request)) as events:
                async for event in events:
                    yield event
            if attempt.failure is None:
                return  # answered (or failed after the commit, which is an answer too)
            last_error = attempt.failure
        yield Meta(route_headers(plan[-1], len(plan), reasons) if plan else {})
        yield last_error or Error(kind="unavailable", message="no route", retryable=True)


def _plan(routes: list[Route]) -> list[Route]:
    """The attempts ``Router.stream`` makes, in order: the first route twice, then the rest
    once. Not twice for an upstream that says no (the MoA: its arbiter already outlives
    failing workers; a second fan-out doubles a dead mesh's load)."""
    if routes and routes[0].upstream.retryable:
        return [routes[0], *routes]
    return list(routes)


def settled_headers(routes: list[Route]) -> dict[str, str]:
    """The route headers that every way ``Router.stream`` can end over ``routes`` has in
    common: what is known before the first event. A response that has to start before its
    route is decided sends these, never the first route's as a guess (a retry may serve it
    elsewhere, after more attempts)."""
    plan = _plan(routes)
    outcomes = [route_headers(route, number, []) for number, route in enumerate(plan, start=1)]
    if not outcomes:
        return {}
    return {k: v for k, v in outcomes[0].items() if all(o.get(k) == v for o in outcomes)}


@dataclass
class _Held:
    """What an attempt holds back until it commits: route facts, the latest prompt count and,
    when the client waits for the whole answer, the answer so far."""

    meta: dict[str, str] = field(default_factory=dict)
    facts: list[Usage | Sampling] = field(default_factory=list)
    deltas: list[Event] = field(default_factory=list)

    def absorb(self, event: Event) -> bool:
        """Keep a fact for later; False for anything else."""
        if isinstance(event, Meta):
            self.meta.update(event.headers)
        elif isinstance(event, Usage | Sampling):  # facts about the answer, not content
            self.facts.append(event)
        else:
            return False
        return True

    def release(self, meta: Meta, committing: Event) -> list[Event]:
        """Everything in the order the client must see it, ending with the committing event."""
        return [meta, *self.facts, *self.deltas, committing]


@dataclass
class _Attempt:
    """One try on one route. ``run`` passes the answer through once it commits; before that it
    holds route facts back and, on a failure that may be retried, stops with ``failure`` set
    (and its reason added to ``reasons``) instead of answering."""

    route: Route
    number: int
    reasons: list[str]
    last: bool
    failure: Error | None = None

    async def run(self, request: ChatRequest) -> AsyncGenerator[Event, None]:
        commit = CommitTracker(streaming=request.stream)
        held = _Held()
        source = self.route.upstream.stream(request)
        try:
            async for event in source:  # until the commit
                if held.absorb(event):
                    continue
                event = commit.seen(event)
                if isinstance(event, Progress):
                    # A note, not content: it goes out (with the route facts known so far, so
                    # they can reach the headers) and a retry stays possible.
                    yield Meta(self._headers() | held.meta)
                    yield event
                elif isinstance(event, Error) and commit.may_retry(event) and not self.last:
                    self._fail(event.kind, event)
                    return
                elif not commit.feed(event):
                    held.deltas.append(event)
                else:
                    for ready in held.release(Meta(self._headers() | held.meta), event):
                        yield ready
                    break
            else:
                ended = "upstream ended before answering"
                self._fail("eof", Error(kind="upstream", message=ended, retryable=True))
                return
            if isinstance(event, Done | Error):
                return
            async for event in source:  # committed: straight through to the terminal
                yield event
                if isinstance(event, Done | Error):
                    return
            yield Error(kind="upstream", message="upstream ended without a terminal event")
        except Exception as exc:  # an upstream bug or a broken connection: translate it here
            answer = self._broke(exc, committed=commit.committed)
            if answer is not None:
                yield answer
        finally:
            await close_stream(source)

    def _broke(self, exc: Exception, *, committed: bool) -> Error | None:
        """The upstream raised: after the commit that is the answer's end; before, a retry."""
        name = self.route.upstream.name
        if committed:
            log.warning("upstream %s failed after commit: %r", name, exc)
            return Error(kind="upstream", message=f"upstream failed: {type(exc).__name__}: {exc}")
        log.info("upstream %s failed before commit: %r", name, exc)
        lost = Error(kind="unavailable", message=f"upstream failed: {exc}", retryable=True)
        self._fail(type(exc).__name__, lost)
        return None

    def _headers(self) -> dict[str, str]:
        return route_headers(self.route, self.number, self.reasons)

    def _fail(self, reason: str, error: Error) -> None:
        self.reasons.append(f"{_route_label(self.route)}:{reason}")
        self.failure = error


def _route_label(route: Route) -> str:
    return route.peer or route.upstream.name


def route_headers(route: Route, attempts: int, reasons: list[str]) -> dict[str, str]:
    headers = {
        "x-route": route.kind,
        "x-peer": route.peer or route.upstream.name,
        "x-attempts": str(attempts),
    }
    if reasons:
        headers["x-retry-reasons"] = ",".join(reasons)
    if route.reason:
        headers[ROUTE_REASON_HEADER] = route.reason
    return headers
