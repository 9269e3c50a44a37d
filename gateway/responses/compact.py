"""``POST /v1/responses/compact``: a long history becomes the user's own messages plus one
``compaction`` item whose content the model itself wrote (a real generation, thinking off); a
history that a summary would not shorten becomes one ``compaction`` item that carries it as it
was (the endpoint always answers with one, as the Open Responses specification has it).

The compacted output is what a client sends as the next turn's input (or continues with
``previous_response_id``: the compaction is stored like a response). Read back, the item is one
message to the model carrying the summary, so the next prompt is shorter by everything the
summary replaced: assistant turns, tool calls and their results, reasoning.
(``encrypted_content``: see :mod:`gateway.responses.compacted`.)
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Protocol

import orjson
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response

from gateway.answer import Accumulator, new_id
from gateway.api.count_tokens import estimate_tokens
from gateway.events import Error
from gateway.exchange import error_response, json_response
from gateway.refusals import RequestInvalid, ResponseStateError, validated
from gateway.request import ChatRequest, Message
from gateway.responses import wire
from gateway.responses.compacted import decode_history, encode_history, encode_summary
from gateway.responses.state import ResponseStates, not_found
from gateway.responses.store import StoredResponse
from gateway.responses.stored import input_items
from gateway.router import RouteError, Router

SUMMARY_MAX_TOKENS = 512
MIN_SUMMARY_TOKENS = 16  # a summary allowed fewer tokens than this is not worth a generation
_ASK = (
    "Write a checkpoint summary of the conversation above for your own later use: the user's"
    " goals, what was done and decided, results of tool calls that still matter, open"
    " questions and the next steps. Be concise and concrete; keep names, numbers, file paths"
    " and identifiers exactly. Reply with the summary only."
)


class CompactState(Protocol):
    """The slice of the gateway's state a compaction reads: where the summary is generated, and
    the stored responses it continues from and is stored in."""

    router: Router
    responses: ResponseStates


class CompactBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]] | None = None
    previous_response_id: str | None = None
    instructions: str | None = None
    prompt_cache_key: str | None = None


def _kept(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What survives compaction verbatim: the user's own messages (the spec's example), not a
    previous compaction item (the new summary covers it)."""
    return [
        item
        for item in history
        if item.get("type", "message") == "message" and item.get("role") == "user"
    ]


async def _summarise(state: CompactState, request: ChatRequest) -> Accumulator:
    acc = Accumulator()
    routes = await state.router.aresolve(request)  # the history is the prefix: where it is cached
    async with contextlib.aclosing(state.router.stream(request, routes)) as events:
        async for event in events:
            acc.add(event)
    return acc


async def _history(state: CompactState, body: CompactBody) -> list[dict[str, Any]]:
    prior: list[dict[str, Any]] = []
    if body.previous_response_id:
        stored = await state.responses.get(body.previous_response_id)
        if stored is None:
            raise not_found(body.previous_response_id, "previous_response_id")
        prior = stored.context
    return [*prior, *input_items(body.input if body.input is not None else [])]


async def _prompt_tokens(
    state: CompactState, model: str, items: list[dict[str, Any]], instructions
) -> int:
    """What ``items`` cost as a prompt: the serving upstream's exact count, else an estimate."""
    chat, _ = wire.parse({"model": model, "input": items, "instructions": instructions})
    # resolve, not aresolve: a count runs no prompt, and a cache-aware ranking would note this
    # one as sent to its first node (and tokenize it once more).
    for route in state.router.resolve(chat):
        count = await route.upstream.count_tokens(chat)
        if count is not None:
            return count
    return estimate_tokens(chat)


async def _compacted(
    state: CompactState, body: CompactBody, history: list[dict[str, Any]]
) -> tuple:
    """The output items and the summary's answer (None when none was generated). A compaction
    must shorten the prompt: the summary may use at most the tokens it replaces, and when even
    that cannot make the prompt shorter the output is one compaction item carrying the history
    unchanged (read back, the very same prompt)."""
    model, instructions = body.model, body.instructions
    history = _unpacked(history)
    kept = _kept(history)
    full = await _prompt_tokens(state, model, history, instructions)
    floor = await _prompt_tokens(state, model, [*kept, _item("")], instructions)
    budget = min(SUMMARY_MAX_TOKENS, full - floor - 1)
    if budget < MIN_SUMMARY_TOKENS:
        return [_unchanged(history)], None  # nothing worth replacing: no generation at all
    chat, _ = wire.parse({"model": model, "input": history, "instructions": instructions})
    ask = chat.model_copy(
        update={
            "messages": [*chat.messages, Message(role="user", content=_ASK)],
            "reasoning": False,  # a summary, not a puzzle: thinking off
            "stream": False,
            "max_tokens": budget,
            "tools": [],
            "tool_choice": "none",
            "session_key": body.prompt_cache_key,
        }
    )
    acc = await _summarise(state, ask)
    if acc.error is not None:
        return [], acc
    output = [*kept, _item(acc.text)]
    if await _prompt_tokens(state, model, output, instructions) >= full:
        return [_unchanged(history)], acc
    return output, acc


def _item(summary: str) -> dict[str, Any]:
    return {
        "id": new_id("cmp_"),
        "type": "compaction",
        "encrypted_content": encode_summary(summary),
    }


def _unchanged(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The compaction item of a history left as it was."""
    return {
        "id": new_id("cmp_"),
        "type": "compaction",
        "encrypted_content": encode_history(history),
    }


def _unpacked(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``history`` with the items of an earlier unchanged compaction in its place: its user
    messages are kept like any others, and compacting again does not wrap it twice."""
    items: list[dict[str, Any]] = []
    for item in history:
        carried = None
        if item.get("type") == "compaction" and isinstance(item.get("encrypted_content"), str):
            carried = decode_history(item["encrypted_content"])
        items += [item] if carried is None else carried
    return items


async def compact(request: Request) -> Response:
    state: CompactState = request.app.state.gateway
    try:
        raw = orjson.loads(await request.body())
        if not isinstance(raw, dict):
            raise RequestInvalid("the request body must be a JSON object")
        body = validated(CompactBody, raw)
        history = await _history(state, body)
        if not history:
            raise RequestInvalid("input: nothing to compact", "input")
        output, acc = await _compacted(state, body, history)
    except orjson.JSONDecodeError as exc:
        return _error(Error(kind="invalid_request", message=f"malformed JSON: {exc}"))
    except RequestInvalid as exc:
        return _error(exc.to_error())
    except (ResponseStateError, RouteError) as exc:
        return _error(exc.error)
    if acc is not None and acc.error is not None:
        return _error(acc.error)
    compacted = {
        "id": state.responses.new_id(),
        "object": "response.compaction",
        "created_at": int(time.time()),
        "output": output,
        "usage": wire.usage_of(acc or Accumulator()),
    }
    state.responses.put(  # continuable by previous_response_id, like any response
        StoredResponse(id=compacted["id"], response=compacted, input_items=history, context=output)
    )
    return json_response(compacted)


def _error(error: Error) -> Response:
    return error_response(wire.error_body, error)  # param: input, not Chat's messages
