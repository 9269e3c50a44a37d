"""``create_app``: the gateway's Starlette app over a model directory (and optionally MoA)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute

from gateway import info_api
from gateway.api import chat, count_tokens, messages, messages_sse
from gateway.api.errors import anthropic_error_body, openai_error_body
from gateway.config import GatewayConfig
from gateway.console import RecentRequests, console_routes
from gateway.events import Error, ErrorKind
from gateway.exchange import ApiEndpoint, ApiSpec, ExchangeState, json_response
from gateway.metrics import GatewayMetrics
from gateway.middleware import GatewayGuard, GuardedState, HostGuard, ServerErrorGuard
from gateway.responses import background, compact, stored, websocket, wire
from gateway.responses.state import LocalResponses, ResponseStates
from gateway.responses.store import ResponseStore
from gateway.router import Router
from gateway.status import StatusSource
from gateway.upstream import ModelDirectory, Upstream


@dataclass
class GatewayState:
    """Everything the endpoints share; lives on ``app.state.gateway``."""

    config: GatewayConfig
    router: Router
    metrics: GatewayMetrics
    responses: ResponseStates
    background: background.BackgroundRuns
    status: StatusSource | None = None
    in_flight: int = 0  # responses running an upstream
    in_flight_guarded: int = 0  # admitted by the in-flight limit (includes parsing/routing)
    waiting: int = 0  # running but no content yet (queued or prefilling upstream)
    started: float = field(default_factory=time.monotonic)
    started_unix: int = field(default_factory=lambda: int(time.time()))


if TYPE_CHECKING:
    # Each consumer declares the slice of this state it reads (a Protocol beside it); endpoints
    # read the state untyped from ``app.state.gateway``, so mypy checks here, in a function never
    # run, that the state gives every consumer its slice.
    def _every_slice(
        state: GatewayState,
    ) -> tuple[
        ExchangeState,
        GuardedState,
        info_api.InfoState,
        count_tokens.CountState,
        stored.StoredState,
        stored.DeletingState,
        background.BackgroundState,
        compact.CompactState,
        websocket.SocketState,
    ]:
        return (state, state, state, state, state, state, state, state, state)


CHAT: ApiSpec[GatewayState] = ApiSpec(
    "chat",
    chat.parse,
    chat.ChatStreamEncoder,
    lambda r, b, acc: chat.completion_body(r, acc),
    chat.error_body,
    open_stream=chat.open_stream,
)
RESPONSES: ApiSpec[GatewayState] = ApiSpec(
    "responses",
    wire.parse,
    wire.ResponsesStreamEncoder,
    wire.response_body,
    wire.error_body,
    shows_progress=True,
    parse_with_state=stored.parse,
    finish=stored.finish,
    detach=background.start,
)
MESSAGES: ApiSpec[GatewayState] = ApiSpec(
    "messages",
    messages.parse,
    messages_sse.MessagesStreamEncoder,
    messages_sse.message_body,
    messages_sse.error_body,
)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Unknown paths and methods answer in the API's error shape, not plain text."""
    status = getattr(exc, "status_code", 500)
    kind: ErrorKind = "not_found" if status == 404 else "invalid_request"
    error = Error(
        kind=kind, message=f"{request.method} {request.url.path}: {getattr(exc, 'detail', '')}"
    )
    shape = (
        anthropic_error_body if request.url.path.startswith("/v1/messages") else openai_error_body
    )
    return json_response(shape(error), status=status, headers=getattr(exc, "headers", None))


def create_app(
    directory: ModelDirectory,
    config: GatewayConfig | None = None,
    *,
    moa: Upstream | None = None,
    extra_routes: Sequence[BaseRoute] = (),
    status: StatusSource | None = None,
    responses: ResponseStates | None = None,
) -> Starlette:
    """The gateway app. ``moa`` serves ``model="mesh"``; ``extra_routes`` lets ``mesh`` add
    endpoints; ``status`` is the node's status picture (:mod:`gateway.status`): it feeds
    ``/health``, ``/api/status`` and the console. ``responses`` holds stored Responses (a node
    injects its mesh-wide view); without it they go to ``config.response_store`` (a file), or
    to memory when that is unset too."""
    config = config or GatewayConfig()
    if responses is None:
        responses = LocalResponses(
            ResponseStore(
                config.response_store,
                max_responses=config.response_store_max,
                max_bytes=config.response_store_max_bytes,
            )
        )
    state = GatewayState(
        config=config,
        router=Router(directory, moa=moa, retry_backoff_s=config.retry_backoff_ms / 1000),
        metrics=GatewayMetrics(config.request_log),
        responses=responses,
        background=background.BackgroundRuns(limit=config.max_in_flight),
        status=status,
    )

    recent_requests = RecentRequests()  # the console's live request table
    state.metrics.listeners.append(recent_requests.record)

    routes: list[BaseRoute] = [
        Route("/v1/chat/completions", ApiEndpoint(CHAT), methods=["POST"]),
        Route("/v1/responses", ApiEndpoint(RESPONSES), methods=["POST"]),
        WebSocketRoute("/v1/responses", websocket.endpoint),
        Route("/v1/responses/compact", compact.compact, methods=["POST"]),
        Route("/v1/responses/{response_id}", stored.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", stored.delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/cancel", background.cancel, methods=["POST"]),
        Route(
            "/v1/responses/{response_id}/input_items",
            stored.list_input_items,
            methods=["GET"],
        ),
        Route("/v1/messages", ApiEndpoint(MESSAGES), methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens.count_tokens, methods=["POST"]),
        Route("/v1/models", info_api.list_models, methods=["GET"]),
        Route("/health", info_api.health, methods=["GET"]),
        Route("/metrics", info_api.metrics, methods=["GET"]),
        Route("/api/status", info_api.status, methods=["GET"]),
        *extra_routes,
        *console_routes(status, directory=directory, requests=recent_requests),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await state.background.aclose()  # runs end (stored as cancelled) before the loop does

    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[
            Middleware(ServerErrorGuard),
            Middleware(HostGuard, allowed_hosts=config.allowed_hosts),
            Middleware(GatewayGuard, state=state),
        ],
        exception_handlers={404: _http_error, 405: _http_error},
    )
    app.state.gateway = state
    return app
