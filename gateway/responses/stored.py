"""Responses state: ``store``, ``previous_response_id``, retrieval, input items and deletion.

A continuation is served as the full-history resend it stands for: the stored context of the
previous response (every input and output item of its chain) goes before the new input, then the
request is parsed as if the client had sent it all. So the rendered prompt is the resend's, token
for token, and the worker's prompt cache hits exactly as it does for a client that resends.
``instructions`` are not carried over (the spec: each request's own instructions apply).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from gateway.answer import new_id
from gateway.api.errors import openai_error_body
from gateway.events import Error
from gateway.exchange import error_response, json_response
from gateway.refusals import RequestInvalid, ResponseStateError
from gateway.request import ChatRequest
from gateway.responses import background, wire
from gateway.responses.request import check_call_outputs
from gateway.responses.state import ResponseStates, not_found, stored_turn
from gateway.responses.store import StoredResponse

DEFAULT_PAGE = 20
MAX_PAGE = 100


class StoredState(Protocol):
    """The slice of the gateway's state stored responses are read from and written to."""

    responses: ResponseStates


class DeletingState(StoredState, Protocol):
    """What a deletion reads besides: the background run it stops first."""

    background: background.BackgroundRuns


def input_items(raw_input: Any) -> list[dict[str, Any]]:
    """The request's ``input`` as a list of items, each with an id (for ``input_items``)."""
    if isinstance(raw_input, str):
        items: list[dict[str, Any]] = [
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": raw_input}],
            }
        ]
    elif isinstance(raw_input, list):
        items = [dict(item) for item in raw_input if isinstance(item, dict)]
    else:
        return []  # not a valid input: parsing the body says so
    for item in items:
        _complete_item(item)
    return items


_ID_PREFIXES = {
    "message": "msg_",
    "function_call": "fc_",
    "function_call_output": "fco_",
    "custom_tool_call": "ctc_",
    "custom_tool_call_output": "ctco_",
}


def _complete_item(item: dict[str, Any]) -> None:
    """Fill what a listed input item carries (id, status, content parts) but a request may leave
    out; the model reads the same text either way."""
    kind = item.setdefault("type", "message")
    item.setdefault("id", new_id(_ID_PREFIXES.get(kind, "item_")))
    if kind in _ID_PREFIXES:
        item.setdefault("status", "completed")
    if kind == "message" and isinstance(item.get("content"), str):
        if item.get("role") == "assistant":
            part = {"type": "output_text", "text": item["content"], "annotations": []}
        else:
            part = {"type": "input_text", "text": item["content"]}
        item["content"] = [part]


async def parse(state: StoredState, raw: dict[str, Any]) -> tuple[ChatRequest, wire.ResponsesBody]:
    """``wire.parse`` with the stored context of ``previous_response_id`` put first."""
    states = state.responses
    previous = raw.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise RequestInvalid("previous_response_id: must be a string", "previous_response_id")
    prior: list[dict[str, Any]] = []
    if previous:
        stored = await states.get(previous)
        if stored is None:
            raise not_found(previous, "previous_response_id")
        prior = stored.context
    return parse_with_prior(state, raw, prior)


def parse_with_prior(
    state: StoredState, raw: dict[str, Any], prior: list[dict[str, Any]]
) -> tuple[ChatRequest, wire.ResponsesBody]:
    """The request with ``prior`` (a previous response's context) before its own input."""
    request, body = wire.parse(raw)  # the body as sent must be valid on its own
    this_turn = input_items(raw["input"])
    check_call_outputs(prior, this_turn)
    if prior:
        request, body = wire.parse({**raw, "input": prior + this_turn})
    body._response_id = state.responses.new_id()
    body._turn_input = this_turn
    body._prior_context = prior
    return request, body


def finish(
    state: StoredState, request: ChatRequest, body: wire.ResponsesBody, response: dict[str, Any]
) -> None:
    """Store a finished (or failed) response unless the request said ``store: false``."""
    if body.store is False:
        return
    state.responses.put(stored_turn(body, response))


def _error(error: Error) -> Response:
    return error_response(openai_error_body, error)


async def _stored(request: Request) -> StoredResponse | Response:
    response_id = request.path_params["response_id"]
    state: StoredState = request.app.state.gateway
    try:
        stored = await state.responses.get(response_id)
    except ResponseStateError as exc:
        return _error(exc.error)
    if stored is None:
        return _error(not_found(response_id).error)
    return stored


async def retrieve(request: Request) -> Response:
    """``GET /v1/responses/{id}``: a background run's object (or its stream), else the
    stored response object."""
    live = background.retrieve(request)
    if live is not None:
        return live
    stored = await _stored(request)
    if isinstance(stored, Response):
        return stored
    return json_response(stored.response)


async def delete(request: Request) -> Response:
    """``DELETE /v1/responses/{id}``: gone for good; a continuation of it is then a 404."""
    response_id = request.path_params["response_id"]
    state: DeletingState = request.app.state.gateway
    if (run := state.background.get(response_id)) is not None:
        run.cancel()  # a deleted response stops generating (and stores its end first)
        await asyncio.wait([run.task])
        state.background.forget(response_id)
    try:
        deleted = await state.responses.delete(response_id)
    except ResponseStateError as exc:
        return _error(exc.error)
    if not deleted:
        return _error(not_found(response_id).error)
    return json_response({"id": response_id, "object": "response", "deleted": True})


def _page_params(request: Request) -> tuple[int, str, str | None]:
    query = request.query_params
    try:
        limit = int(query.get("limit", DEFAULT_PAGE))
    except ValueError:
        raise RequestInvalid("limit: must be an integer from 1 to 100", "limit") from None
    if not 1 <= limit <= MAX_PAGE:
        raise RequestInvalid("limit: must be an integer from 1 to 100", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise RequestInvalid("order: must be 'asc' or 'desc'", "order")
    return limit, order, query.get("after")


async def list_input_items(request: Request) -> Response:
    """``GET /v1/responses/{id}/input_items``: the turn's input items, paginated by item id."""
    try:
        limit, order, after = _page_params(request)
    except RequestInvalid as exc:
        return _error(exc.to_error())
    stored = await _stored(request)
    if isinstance(stored, Response):
        return stored
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            return _error(
                Error(
                    kind="invalid_request",
                    message=f"after: no input item {after!r} in response {stored.id}",
                    details={"param": "after"},
                )
            )
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return json_response(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )
