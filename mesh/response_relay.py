"""Stored Responses across the mesh: a response id names its node, and any node can use it.

A response is stored where it was made (``<home>/responses.sqlite3`` of the entry node). Its id
carries that node's tag (the first 12 hex digits of its id), so a ``GET``, ``DELETE`` or
``previous_response_id`` sent to another node is answered by fetching it from the owner over the
tunnel – one stream per call::

    → RequestHead{path=/mesh/v1/responses} Body({"op": "get"|"delete", "id": ...}) BodyEnd
    ← ResponseHead{200} Data(chunk of the stored row's JSON)* End          found (get/delete)
    ← ResponseHead{404} End                                                not there

The continuation then runs (and is stored) on the node that received it, under its own id; the
stored row is self-contained (its whole context), so one fetch is all a continuation needs. An
owner that is a member but cannot be reached now is a 503 with Retry-After, never a 404.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import Any

import orjson

from gateway.responses.state import LocalResponses, owner_tag, owner_unavailable
from gateway.responses.store import StoredResponse
from mesh.errors import MeshError
from mesh.tunnel.frames import MAX_PAYLOAD, Body, BodyEnd, Data, End, RequestHead, ResponseHead

log = logging.getLogger(__name__)

RESPONSES_PATH = "/mesh/v1/responses"
TAG_LENGTH = 12
ASK_TIMEOUT_S = 10.0
_CHUNK = MAX_PAYLOAD // 2


def node_tag(node_id: str) -> str:
    return node_id[:TAG_LENGTH]


def _row(item: StoredResponse) -> dict[str, Any]:
    return {
        "id": item.id,
        "response": item.response,
        "input_items": item.input_items,
        "context": item.context,
        "created_at": item.created_at,
    }


def _from_row(row: dict[str, Any]) -> StoredResponse:
    return StoredResponse(
        id=str(row["id"]),
        response=dict(row["response"]),
        input_items=list(row["input_items"]),
        context=list(row["context"]),
        created_at=float(row["created_at"]),
    )


async def serve(stream, body: bytes, local: LocalResponses) -> None:
    """Answer one peer's ``get``/``delete`` of a response stored here."""
    try:
        ask = orjson.loads(body)
        op, response_id = ask["op"], ask["id"]
        if op not in ("get", "delete") or not isinstance(response_id, str):
            raise ValueError(op)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        await stream.send(ResponseHead(status=400, headers={"x-error": "bad responses request"}))
        await stream.send(End())
        return
    item = local.store.get(response_id)
    if item is None or (op == "delete" and not local.store.delete(response_id)):
        await stream.send(ResponseHead(status=404))
        await stream.send(End())
        return
    await stream.send(ResponseHead(status=200))
    data = orjson.dumps(_row(item)) if op == "get" else b"{}"
    for start in range(0, len(data), _CHUNK):
        await stream.send(Data(data[start : start + _CHUNK]))
    await stream.send(End())


class MeshResponses:
    """:class:`~gateway.response_state.ResponseStates` for a node: its own store, and its
    peers' through the tunnel. ``links`` returns the live connections by peer id,
    ``members`` the ids of every member (an owner that is a member but has no link is 503)."""

    def __init__(
        self,
        local: LocalResponses,
        links: Callable[[], dict[str, Any]],
        members: Callable[[], set[str]],
    ) -> None:
        self.local = local
        self._links = links
        self._members = members

    def new_id(self) -> str:
        return self.local.new_id()

    def put(self, item: StoredResponse) -> None:
        self.local.put(item)

    async def get(self, response_id: str) -> StoredResponse | None:
        if self.local.owns(response_id):
            return await self.local.get(response_id)
        row = await self._ask("get", response_id)
        if row is None:
            return None
        try:
            return _from_row(row)
        except (KeyError, TypeError, ValueError) as exc:
            raise owner_unavailable(response_id, "the owner sent a malformed response") from exc

    async def delete(self, response_id: str) -> bool:
        if self.local.owns(response_id):
            return await self.local.delete(response_id)
        return await self._ask("delete", response_id) is not None

    def _owner(self, response_id: str) -> str | None:
        tag = owner_tag(response_id)
        for node_id in self._members():
            if node_tag(node_id) == tag:
                return node_id
        return None

    async def _ask(self, op: str, response_id: str) -> dict[str, Any] | None:
        owner = self._owner(response_id)
        if owner is None:
            return None  # no member made it: plain not found
        conn = self._links().get(owner)
        if conn is None or conn.is_closed:
            raise owner_unavailable(response_id, "no live link to it")
        try:
            async with asyncio.timeout(ASK_TIMEOUT_S):
                return await _ask_over(conn, op, response_id)
        except (MeshError, OSError, TimeoutError) as exc:
            log.info("asking %s for %s failed: %s", owner[:8], response_id, exc)
            raise owner_unavailable(response_id, str(exc) or type(exc).__name__) from exc


async def _ask_over(conn, op: str, response_id: str) -> dict[str, Any] | None:
    stream = await conn.open_stream()
    head = RequestHead(id=secrets.token_hex(8), path=RESPONSES_PATH, deadline=ASK_TIMEOUT_S)
    await stream.send(head)
    await stream.send(Body(orjson.dumps({"op": op, "id": response_id})))
    await stream.send(BodyEnd())
    first = await stream.recv()
    if not isinstance(first, ResponseHead):
        raise owner_unavailable(response_id, "the owner refused")
    data = bytearray()
    async for frame in stream:
        if isinstance(frame, Data):
            data += frame.data
        elif isinstance(frame, End):
            break
    if first.status == 404:
        return None
    if first.status != 200:
        raise owner_unavailable(response_id, f"the owner answered {first.status}")
    try:
        row = orjson.loads(bytes(data))
    except orjson.JSONDecodeError as exc:
        raise owner_unavailable(response_id, "the owner sent malformed JSON") from exc
    if not isinstance(row, dict):
        raise owner_unavailable(response_id, "the owner sent malformed JSON")
    return row
