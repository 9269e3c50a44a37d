"""The mesh's HTTP endpoints on the gateway (added through ``create_app(extra_routes=...)``).

``POST /api/mesh/invite``  ``{"ttl_s": 3600}`` → ``{"token": "mlxmesh1.…"}`` (``mesh invite``)
``GET /api/mesh/members``  every member (node id, addresses, linked now, who admitted it) and
every removed node (who removed it, when) (``mesh members list``)
``POST /api/mesh/members/remove``  ``{"node": "<id or prefix>", "keep": [...], "dry_run": false}``
→ ``{"removed", "going_with", "kept", "dry_run"}`` (``mesh members remove``)
``GET /api/mesh/models``, ``POST /api/mesh/models/pull``  peer copy (see :mod:`mesh.copy.http`)

Minting invites and removing members are admin actions: allowed from loopback, or from anywhere
only when the gateway has an API key (its middleware has then already checked it). ``GET /api/status`` is the
gateway's own, fed by the node's status source.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import BaseModel, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from mesh.addresses import LOOPBACK_HOSTS
from mesh.copy.http import copy_routes
from mesh.errors import MembershipError
from mesh.membership.invite import DEFAULT_TTL_S, MAX_TTL_S

if TYPE_CHECKING:
    from mesh.service import MeshService


class InviteRequest(BaseModel):
    ttl_s: float = Field(default=DEFAULT_TTL_S, gt=0, le=MAX_TTL_S)


class RemoveRequest(BaseModel):
    node: str = Field(min_length=1, max_length=64)
    keep: list[str] = Field(default_factory=list, max_length=128)  # ids or prefixes
    dry_run: bool = False


CSRF_HEADER = "x-mesh-csrf"
Handler = Callable[[Request, dict[str, Any]], Awaitable[Response]]


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


@dataclass(frozen=True)
class AdminGuard:
    """Who may call an admin route: loopback (or anyone, once the gateway has a key that its
    middleware checked), with a JSON body, and – without a key – the node's CSRF token."""

    api_key: str | None
    csrf: str

    def wrap(self, handler: Handler, what: str) -> Callable[[Request], Awaitable[Response]]:
        async def guarded(request: Request) -> Response:
            refusal = self._refusal(request, what)
            if refusal is not None:
                return refusal
            raw = await request.body()
            try:
                body = orjson.loads(raw) if raw else {}
            except orjson.JSONDecodeError as exc:
                return _error(400, f"bad request: {exc}", "invalid_request_error")
            if not isinstance(body, dict):
                return _error(400, "bad request: expected a JSON object", "invalid_request_error")
            return await handler(request, body)

        return guarded

    def _refusal(self, request: Request, what: str) -> Response | None:
        client = request.client.host if request.client else ""
        if client not in LOOPBACK_HOSTS and not self.api_key:
            return _error(403, f"{what} from loopback only", "permission_error")
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return _error(415, f"{what} takes a JSON body", "invalid_request_error")
        given = request.headers.get(CSRF_HEADER, "")
        if not self.api_key and not hmac.compare_digest(given.encode(), self.csrf.encode()):
            return _error(403, f"{what} needs the node's {CSRF_HEADER} token", "permission_error")
        return None


def mesh_routes(
    service: MeshService, *, api_key: str | None, csrf_token: str | None = None
) -> list[BaseRoute]:
    """The mesh's admin endpoints. ``csrf_token`` (the node makes one per start and writes it to
    its 0600 ``node.json``; the console fetches it same-origin) is asked of every admin POST
    when the gateway has no API key: a page on another site can neither read it nor send JSON
    without a preflight we never grant."""
    csrf = csrf_token or secrets.token_urlsafe(24)
    admin = AdminGuard(api_key, csrf).wrap

    async def invite(request: Request, body: dict[str, Any]) -> Response:
        try:
            asked = InviteRequest.model_validate(body)
        except ValidationError as exc:
            return _error(400, f"bad invite request: {exc}", "invalid_request_error")
        token = service.create_invite(asked.ttl_s)
        return JSONResponse({"token": token.encode(), "expires_at": token.expires_at})

    async def remove(request: Request, body: dict[str, Any]) -> Response:
        try:
            asked = RemoveRequest.model_validate(body)
            report = service.remove_member(asked.node, asked.keep, asked.dry_run)
        except ValidationError as exc:
            return _error(400, f"bad remove request: {exc}", "invalid_request_error")
        except MembershipError as exc:
            return _error(400, str(exc), "invalid_request_error")
        return JSONResponse(
            {
                "removed": report.node_id,
                "going_with": report.going_with,
                "kept": report.kept,
                "dry_run": asked.dry_run,
            }
        )

    async def members(request: Request) -> Response:
        return JSONResponse({"members": service.member_rows(), "removed": service.removed_rows()})

    async def csrf_token_route(request: Request) -> Response:
        # Same-origin reads only: no CORS headers, and the Host guard refuses rebound names.
        return JSONResponse({"token": csrf}, headers={"cache-control": "no-store"})

    routes: list[BaseRoute] = []
    if getattr(service, "copy", None) is not None:  # a service without peer copy has no routes
        copy_models, copy_pull = copy_routes(service.copy)
        routes += [
            Route("/api/mesh/models", copy_models, methods=["GET"]),
            Route(
                "/api/mesh/models/pull", admin(copy_pull, "models can be pulled"), methods=["POST"]
            ),
        ]
    return [
        *routes,
        Route("/api/mesh/invite", admin(invite, "invites can be minted"), methods=["POST"]),
        Route("/api/mesh/members", members, methods=["GET"]),
        Route(
            "/api/mesh/members/remove",
            admin(remove, "members can be removed"),
            methods=["POST"],
        ),
        Route("/api/mesh/csrf", csrf_token_route, methods=["GET"]),
    ]
