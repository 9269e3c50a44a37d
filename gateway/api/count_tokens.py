"""``POST /v1/messages/count_tokens``: the serving worker's exact count, else an estimate."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.errors import RequestInvalid
from gateway.api.messages import MessageIn, ToolIn, error_body, messages_of, tools_of
from gateway.events import Error
from gateway.exchange import error_response, json_response
from gateway.request import ChatRequest
from gateway.router import RouteError


class CountTokensBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[MessageIn]
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolIn] | None = None


async def count_tokens(request: Request) -> Response:
    """Exact count from the serving upstream's tokenizer when it offers one, else an estimate.

    The ``x-token-count`` header says which: ``exact`` or ``estimate``.
    """
    state = request.app.state.gateway
    try:
        raw = orjson.loads(await request.body())
        body = CountTokensBody.model_validate(raw)
        chat_request = ChatRequest(
            model=body.model,
            messages=messages_of(body),
            tools=tools_of(body),
            max_tokens=1,
            stream=False,
        )
    except orjson.JSONDecodeError as exc:
        return error_response(
            error_body, Error(kind="invalid_request", message=f"malformed JSON: {exc}")
        )
    except ValidationError as exc:
        return error_response(error_body, RequestInvalid.from_validation(exc).to_error())
    except RequestInvalid as exc:
        return error_response(error_body, exc.to_error())
    try:
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
