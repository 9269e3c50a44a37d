"""Where stored Responses live, as the gateway sees it: this node's store, or a peer's.

A response id names the node that stored it (``resp_<node tag>_<random>``), so any node of a mesh
can tell whose a response is. The gateway only knows :class:`ResponseStates`; ``mesh`` injects
one that fetches a peer's responses over the tunnel, and a standalone gateway uses
:class:`LocalResponses` over its own :class:`~gateway.responses.store.ResponseStore`. A stored
response that cannot be used (not found, its node unreachable) is refused with a
:class:`~gateway.refusals.ResponseStateError` made here.
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING, Any, Protocol

from gateway.events import Error
from gateway.refusals import ResponseStateError
from gateway.responses.store import ResponseStore, StoredResponse

if TYPE_CHECKING:
    from gateway.responses.request import ResponsesBody

_PREFIX = "resp_"


def not_found(response_id: str, param: str | None = None) -> ResponseStateError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    code = "previous_response_not_found" if param == "previous_response_id" else None
    return ResponseStateError(
        Error(
            kind="not_found",
            message=f"{what} with id '{response_id}' not found.",
            code=code,
            details={"param": param},
        )
    )


def owner_unavailable(response_id: str, why: str) -> ResponseStateError:
    """The response belongs to a node that cannot be reached now: 503 (retry later), not 404."""
    return ResponseStateError(
        Error(
            kind="unavailable",
            message=f"response {response_id} is stored on a node that cannot be reached: {why}",
            retryable=True,
        )
    )


def new_response_id(node_tag: str = "") -> str:
    tag = f"{node_tag}_" if node_tag else ""
    return f"{_PREFIX}{tag}{secrets.token_hex(12)}"


def owner_tag(response_id: str) -> str:
    """The node tag inside ``response_id`` ('' for an id without one, e.g. from an old node)."""
    if not response_id.startswith(_PREFIX):
        return ""
    tag, sep, _ = response_id[len(_PREFIX) :].partition("_")
    return tag if sep else ""


class ResponseStates(Protocol):
    """Stored responses across wherever they live. ``get``/``delete`` may raise
    :class:`ResponseStateError` (the owner is unreachable); ``put`` writes this node's store."""

    def new_id(self) -> str: ...
    def put(self, item: StoredResponse) -> None: ...
    async def get(self, response_id: str) -> StoredResponse | None: ...
    async def delete(self, response_id: str) -> bool: ...


class LocalResponses:
    """This node's own store; ids carry ``node_tag``."""

    def __init__(self, store: ResponseStore, node_tag: str = "") -> None:
        self.store = store
        self.node_tag = node_tag

    def new_id(self) -> str:
        return new_response_id(self.node_tag)

    def owns(self, response_id: str) -> bool:
        tag = owner_tag(response_id)
        return not tag or tag == self.node_tag

    def put(self, item: StoredResponse) -> None:
        self.store.put(item)

    async def get(self, response_id: str) -> StoredResponse | None:
        return self.store.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)


def stored_turn(body: ResponsesBody, response: dict[str, Any]) -> StoredResponse:
    """One turn as it is kept: the response, this turn's input items, and the context a
    continuation of it starts from (the chain's items, this turn's input and output)."""
    output = [item for item in response.get("output", []) if isinstance(item, dict)]
    return StoredResponse(
        id=response["id"],
        response=response,
        input_items=body._turn_input,
        context=[*body._prior_context, *body._turn_input, *output],
        created_at=float(response.get("created_at") or time.time()),
    )
