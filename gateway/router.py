"""Pick routes for a model and run one request across them, retrying before the commit point.

The commit point is the first content delta (or terminal); an early ``Usage`` waits for it, and
a ``Progress`` note passes through without committing (it is not part of the answer). A
failure before it – an ``Error`` that is retryable or of kind overloaded/unavailable, an
exception, or a stream that ends early – is retried once on the same route after
``retry_backoff_s``, then on the next route (the MoA route is not retried: its arbiter already
deals with failing workers). After it, nothing is retried: the error goes on to
the client. Every routed stream starts with a ``Meta`` event carrying ``x-route``, ``x-peer``
and ``x-attempts``, merged with the upstream's own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from gateway.events import Done, Error, Event, Meta, Progress, Usage
from gateway.request import ChatRequest
from gateway.upstream import ModelDirectory, Route

log = logging.getLogger(__name__)

MESH_MODEL = "mesh"
_RETRY_KINDS = frozenset({"overloaded", "unavailable"})


class RouteError(Exception):
    """No route for the request: carries the ``Error`` to answer with (404 or 503)."""

    def __init__(self, error: Error) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass
class _UpstreamAdapter:
    """Gives an object with only ``.stream(request)`` (the MoA arbiter) an upstream name."""

    target: Any
    name: str = "moa"

    def stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        return self.target.stream(request)

    # The MoA decides late; these let the gateway hold the response start for its decision.
    @property
    def decision_header(self) -> str | None:
        return getattr(self.target, "decision_header", None)

    @property
    def decision_wait_s(self) -> float:
        return getattr(self.target, "decision_wait_s", 0.0)


def is_retryable(error: Error) -> bool:
    return error.retryable or error.kind in _RETRY_KINDS


class Router:
    def __init__(
        self, directory: ModelDirectory, *, moa: Any = None, retry_backoff_s: float = 0.75
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
            name = getattr(self.moa, "name", "moa")
            return [Route(upstream=_UpstreamAdapter(self.moa, name), kind="moa")]
        routes = self.directory.routes(request.model, request.session_key)
        if routes:
            return routes
        known = self.model_ids()
        if request.model in known:
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

    async def stream(self, request: ChatRequest, routes: list[Route]) -> AsyncIterator[Event]:
        """Run ``request`` over ``routes`` with retry-before-commit; always ends with a terminal."""
        # The first route twice, then the rest once. Not the MoA route: its arbiter already
        # outlives failing workers, and a second fan-out would only double a dead mesh's load.
        retry_first = bool(routes) and routes[0].kind != "moa"
        plan = [routes[0], *routes] if retry_first else list(routes)
        reasons: list[str] = []
        last_error: Error | None = None
        for attempt, route in enumerate(plan, start=1):
            if attempt > 1 and route is plan[attempt - 2]:
                await asyncio.sleep(self.retry_backoff_s)
            pending_meta: dict[str, str] = {}
            pending_usage: Usage | None = None
            committed = False
            source = route.upstream.stream(request)
            try:
                async for event in source:
                    if committed:
                        yield event
                        if isinstance(event, Done | Error):
                            return
                        continue
                    if isinstance(event, Meta):
                        pending_meta.update(event.headers)
                        continue
                    if isinstance(event, Usage):  # an early prompt count: a fact, not content
                        pending_usage = event
                        continue
                    if isinstance(event, Progress):
                        # A note, not content: it goes out (with the route facts known so far, so
                        # they can reach the headers) and a retry stays possible.
                        yield Meta(route_headers(route, attempt, reasons) | pending_meta)
                        yield event
                        continue
                    if isinstance(event, Error) and is_retryable(event) and attempt < len(plan):
                        reasons.append(f"{_route_label(route)}:{event.kind}")
                        last_error = event
                        break
                    committed = True
                    yield Meta(route_headers(route, attempt, reasons) | pending_meta)
                    if pending_usage is not None:
                        yield pending_usage
                    yield event
                    if isinstance(event, Done | Error):
                        return
                else:
                    if committed:
                        yield Error(
                            kind="upstream", message="upstream ended without a terminal event"
                        )
                        return
                    reasons.append(f"{_route_label(route)}:eof")
                    last_error = Error(
                        kind="upstream", message="upstream ended before answering", retryable=True
                    )
            except Exception as exc:  # an upstream bug or a broken connection: translate it here
                if committed:
                    log.warning("upstream %s failed after commit: %r", route.upstream.name, exc)
                    yield Error(
                        kind="upstream", message=f"upstream failed: {type(exc).__name__}: {exc}"
                    )
                    return
                log.info("upstream %s failed before commit: %r", route.upstream.name, exc)
                reasons.append(f"{_route_label(route)}:{type(exc).__name__}")
                last_error = Error(
                    kind="unavailable", message=f"upstream failed: {exc}", retryable=True
                )
            finally:
                closer = getattr(source, "aclose", None)
                if closer is not None:
                    await closer()
        yield Meta(route_headers(plan[-1], len(plan), reasons) if plan else {})
        yield last_error or Error(kind="unavailable", message="no route", retryable=True)


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
    return headers
