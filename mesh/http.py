"""The mesh's HTTP endpoints on the gateway (added through ``create_app(extra_routes=...)``).

``POST /api/mesh/invite``  ``{"ttl_s": 3600}`` → ``{"token": "mlxmesh1.…"}`` (``mesh invite``)

Minting invites is an admin action: allowed from loopback, or from anywhere only when the gateway
has an API key (its middleware has then already checked it). ``GET /api/status`` is the
gateway's own, fed by the node's status source.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from pydantic import BaseModel, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from mesh.membership.invite import DEFAULT_TTL_S, MAX_TTL_S

if TYPE_CHECKING:
    from mesh.service import MeshService

_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


class InviteRequest(BaseModel):
    ttl_s: float = Field(default=DEFAULT_TTL_S, gt=0, le=MAX_TTL_S)


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def mesh_routes(service: MeshService, *, api_key: str | None) -> list[BaseRoute]:
    async def invite(request: Request) -> Response:
        client = request.client.host if request.client else ""
        if client not in _LOOPBACK and not api_key:
            return _error(403, "invites can be minted from loopback only", "permission_error")
        raw = await request.body()
        try:
            body = InviteRequest.model_validate(orjson.loads(raw) if raw else {})
        except (orjson.JSONDecodeError, ValidationError) as exc:
            return _error(400, f"bad invite request: {exc}", "invalid_request_error")
        token = service.create_invite(body.ttl_s)
        return JSONResponse({"token": token.encode(), "expires_at": token.expires_at})

    return [
        Route("/api/mesh/invite", invite, methods=["POST"]),
    ]
