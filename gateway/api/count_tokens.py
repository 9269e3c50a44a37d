"""``POST /v1/messages/count_tokens``: the serving worker's exact count, else an estimate."""

from __future__ import annotations

from typing import Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.messages import ConversationBody, request_of
from gateway.api.messages_sse import error_body
from gateway.events import Error
from gateway.exchange import error_response, json_response
from gateway.refusals import RequestInvalid, validated
from gateway.request import ChatRequest
from gateway.router import RouteError, Router


def parse(raw: Any) -> ChatRequest:
    """The body, validated as a Messages body is (``max_tokens`` optional), as the 1-token
    request whose prompt is counted; thinking and tool choice shape that prompt too."""
    if not isinstance(raw, dict):
        raise RequestInvalid("the request body must be a JSON object")
    asked = request_of(validated(ConversationBody, raw), raw)
    return ChatRequest(
        model=asked.model,
        messages=asked.messages,
        tools=asked.tools,
        tool_choice=asked.tool_choice,
        reasoning=asked.reasoning,
        max_tokens=1,
        stream=False,
    )


class CountState(Protocol):
    """The slice of the gateway's state a count reads: where the request would go."""

    router: Router


async def count_tokens(request: Request) -> Response:
    """Exact count from the serving upstream's tokenizer when it offers one, else an estimate.

    The ``x-token-count`` header says which: ``exact`` or ``estimate``.
    """
    state: CountState = request.app.state.gateway
    try:
        chat_request = parse(orjson.loads(await request.body()))
    except orjson.JSONDecodeError as exc:
        return error_response(
            error_body, Error(kind="invalid_request", message=f"malformed JSON: {exc}")
        )
    except RequestInvalid as exc:
        return error_response(error_body, exc.to_error())
    try:
        # resolve, not aresolve: a count runs no prompt, and a cache-aware ranking would note
        # this one as sent to its first node (and tokenize it once more).
        routes = state.router.resolve(chat_request)
    except RouteError as exc:
        return error_response(error_body, exc.error)
    for route in routes:
        count = await route.upstream.count_tokens(chat_request)
        if count is not None:
            return json_response({"input_tokens": count}, headers={"x-token-count": "exact"})
    return json_response(
        {"input_tokens": estimate_tokens(chat_request)}, headers={"x-token-count": "estimate"}
    )


def estimate_tokens(request: ChatRequest) -> int:
    """About four characters a token, plus a few per turn for the chat template's markers."""
    chars = sum(
        len(m.content)
        + len(m.reasoning or "")
        + sum(len(c.arguments) + len(c.name) for c in m.tool_calls)
        for m in request.messages
    )
    chars += sum(len(orjson.dumps(t.model_dump())) for t in request.tools)
    return max(1, chars // 4 + 4 * len(request.messages))
