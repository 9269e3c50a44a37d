"""``GET /v1/models``, ``GET /health`` and ``GET /metrics``."""

from __future__ import annotations

import logging
import time
from typing import Protocol

from starlette.requests import Request
from starlette.responses import Response

from gateway.config import GatewayConfig
from gateway.exchange import json_response
from gateway.metrics import GatewayMetrics
from gateway.router import Router
from gateway.status import StatusSource, health_facts, read_status
from gateway.upstream import MESH_MODEL

log = logging.getLogger(__name__)


class InfoState(Protocol):
    """The slice of the gateway's state these endpoints report."""

    config: GatewayConfig  # version
    router: Router
    metrics: GatewayMetrics
    status: StatusSource | None
    started: float
    started_unix: int
    in_flight: int
    waiting: int


async def list_models(request: Request) -> Response:
    state: InfoState = request.app.state.gateway
    data = []
    for info in state.router.directory.models():
        entry = {
            "id": info.id,
            "object": "model",
            "created": state.started_unix,
            "owned_by": info.owned_by,
        }
        entry["architecture"] = info.architecture
        if info.parameters is not None:
            entry["parameters"] = info.parameters
        if info.context_length is not None:
            entry["context_length"] = info.context_length
        if info.capabilities:
            entry["capabilities"] = info.capabilities
        data.append(entry)
    if state.router.moa is not None and all(e["id"] != MESH_MODEL for e in data):
        data.append(
            {"id": MESH_MODEL, "object": "model", "created": state.started_unix, "owned_by": "mesh"}
        )
    return json_response({"object": "list", "data": data})


async def health(request: Request) -> Response:
    state: InfoState = request.app.state.gateway
    body = {
        "status": "ok",
        "version": state.config.version,
        "models": state.router.model_ids(),
        "queue_depth": state.waiting,
        "in_flight": state.in_flight,
        "uptime_s": round(time.monotonic() - state.started, 3),
    }
    if state.status is not None:
        try:
            body |= health_facts(await read_status(state.status, None))
        except Exception as exc:  # the node's extra facts are optional; liveness is not
            log.exception("status source failed")
            body["status_error"] = f"{type(exc).__name__}: {exc}"
    return json_response(body)


async def status(request: Request) -> Response:
    """``GET /api/status``: this node and every peer it knows (the console's picture)."""
    state: InfoState = request.app.state.gateway
    return json_response(await read_status(state.status, state.router.directory))


async def metrics(request: Request) -> Response:
    state: InfoState = request.app.state.gateway
    # A node's picture carries its workers' speculation counters and every node's cache view.
    if state.status is not None:
        try:
            picture = await read_status(state.status, None)
            state.metrics.speculation.update(picture.get("workers") or {})
            state.metrics.node_cache.update(picture)
        except Exception:  # the request metrics still answer
            log.exception("status source failed")
    return Response(
        state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8"
    )
