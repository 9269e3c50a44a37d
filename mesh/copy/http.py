"""The node's peer-copy endpoints (added to ``mesh_routes``).

``GET /api/mesh/models``  ``{"stored": [names here], "holders": {name: [node ids]}}``
``POST /api/mesh/models/pull``  ``{"name": "...", "from": "<node id or prefix>"?}`` → 404 when no
member holds NAME (the CLI then falls back to the registry); otherwise an NDJSON stream of
progress events that ends with ``{"type": "done", "path": ...}`` or ``{"type": "error",
"message": ...}``::

    {"type": "progress", "name": ..., "total": ..., "done": ..., "resumed": ...,
     "by_source": {node id: bytes}, "dropped": {node id: why}, "elapsed_s": ...}

The copy runs in the node (it holds the live links whose certificates pin the peers, and the
peer table that says who holds what); the CLI and the console only start it and draw it. A
client that goes away cancels the copy; what was copied waits in ``.partial`` for the next pull.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import BaseModel, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from mesh.copy.progress import CopyProgress
from mesh.errors import CopyError

if TYPE_CHECKING:
    from mesh.copy.service import PeerCopy

PROGRESS_EVERY_S = 0.1


class PullRequest(BaseModel):
    name: str = Field(min_length=1, max_length=128)
    from_node: str | None = Field(default=None, alias="from", max_length=64)


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def progress_event(p: CopyProgress) -> dict[str, Any]:
    return {
        "type": "progress",
        "name": p.name,
        "total": p.total_bytes,
        "done": p.done_bytes,
        "resumed": p.resumed_bytes,
        "by_source": dict(p.by_source),
        "dropped": dict(p.dropped),
        "elapsed_s": round(time.monotonic() - p.started_at, 3),
    }


async def pull_events(copy: PeerCopy, name: str, only: str | None) -> AsyncIterator[bytes]:
    """Run one pull and yield its NDJSON lines (throttled progress, then done or error)."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    last = 0.0

    def sink(p: CopyProgress) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY_S or p.done_bytes == p.total_bytes:
            last = now
            queue.put_nowait(progress_event(p))

    async def run() -> None:
        try:
            path = await copy.pull(name, only=only, on_progress=sink)
        except CopyError as exc:
            queue.put_nowait({"type": "error", "message": str(exc), "kind": type(exc).__name__})
        else:
            queue.put_nowait({"type": "done", "name": name, "path": str(path)})

    task = asyncio.create_task(run())
    try:
        while True:
            event = await queue.get()
            yield orjson.dumps(event) + b"\n"
            if event["type"] in ("done", "error"):
                return
    finally:
        task.cancel()  # the client left: stop copying (the partial files stay for a resume)
        await asyncio.gather(task, return_exceptions=True)


def copy_routes(copy: PeerCopy) -> tuple[Any, Any]:
    """(the GET handler, the admin POST handler) for ``mesh.http`` to mount."""

    async def models(request: Request) -> Response:
        from mesh.copy.service import stored_model_names

        return JSONResponse({"stored": stored_model_names(copy.home), "holders": copy.holders()})

    async def pull(request: Request, body: dict[str, Any]) -> Response:
        try:
            asked = PullRequest.model_validate(body)
            sources = copy.sources(asked.name, asked.from_node)
        except ValidationError as exc:
            return _error(
                400, f"bad pull request: {exc.errors()[0]['msg']}", "invalid_request_error"
            )
        except CopyError as exc:
            return _error(400, str(exc), "invalid_request_error")
        if not sources:
            return _error(404, f"no linked member holds {asked.name}", "not_found_error")
        return StreamingResponse(
            pull_events(copy, asked.name, asked.from_node), media_type="application/x-ndjson"
        )

    return models, pull
