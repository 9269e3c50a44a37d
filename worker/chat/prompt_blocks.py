"""``POST /v1/prompt_blocks``: a chat request's prompt as cache-digest block hashes, and
``POST /v1/prompt_cache/held``: how much of such a prompt this worker holds now.

The entry node of a mesh asks its own worker for these (it has the model's tokenizer and chat
template) and looks them up in every node's :class:`~worker.prompt_cache.digest.CacheDigest` to route
a request where its prefix is cached. The prompt is rendered as for generation (thinking knob,
tools in full, a structured answer without a think block) but nothing runs; an estimate is
enough here, so tools shortened to fit the context are not modelled.
"""

from __future__ import annotations

import asyncio
from typing import Any

import jinja2
import orjson
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from worker.chat.response_format import OutputFormatError, output_grammar
from worker.chat.schemas import ChatCompletionRequest
from worker.chat.thinking import normalize_thinking
from worker.prompt_cache.digest import block_hashes


def _bad(message: str) -> Response:
    body = {"error": {"message": message, "type": "invalid_request_error"}}
    return Response(orjson.dumps(body), status_code=400, media_type="application/json")


def render_inputs(chat: ChatCompletionRequest, body: dict[str, Any]) -> tuple[list, list | None, dict]:  # fmt: skip
    """Messages, tools and template kwargs as the generation path renders them."""
    template_kwargs = dict(chat.chat_template_kwargs or {})
    thinking = normalize_thinking(body)
    if thinking is not None:
        template_kwargs["enable_thinking"] = thinking
    offered = chat.tools if chat.tool_choice != "none" else None
    tools = [t.model_dump(exclude_none=True) for t in offered] if offered else None
    try:
        grammar = output_grammar(chat.response_format, bool(tools))
    except OutputFormatError:
        grammar = None  # the real request will get its 400; the estimate does not matter
    if grammar is not None:
        template_kwargs["enable_thinking"] = False
    return [m.to_template() for m in chat.messages], tools, template_kwargs


async def prompt_blocks(request: Request) -> Response:
    """``{"block_size", "prompt_tokens", "hashes"}`` for the chat body posted."""
    engine = request.app.state.engine
    template = request.app.state.template
    try:
        body = orjson.loads(await request.body())
        chat = ChatCompletionRequest.model_validate(body)
    except (orjson.JSONDecodeError, ValidationError) as exc:
        return _bad(f"not a chat request: {exc}")
    messages, tools, kwargs = render_inputs(chat, body)
    try:
        tokens, _ = await asyncio.to_thread(template.render, messages, tools, kwargs)
    except jinja2.TemplateError as exc:
        return _bad(f"the chat template rejected the messages: {exc}")
    size = engine.cache_digest.block_size
    out = {"block_size": size, "prompt_tokens": len(tokens), "hashes": block_hashes(tokens, size)}
    return Response(orjson.dumps(out), media_type="application/json")


MAX_HELD_HASHES = 16384  # a 1M-token prompt in blocks of 64: anything longer is no prompt of ours


async def prompt_cache_held(request: Request) -> Response:
    """``{"block_size", "cached_tokens", "memory_tokens", "disk_tokens", "restore_tok_s",
    "pending_tokens", "queue_depth", "in_flight", "prefill_backlog", "prefill_tok_s"}`` for
    ``{"block_size", "hashes"}``: the prefix the prompt cache holds now (in memory, on disk with
    the rate a restore ran at), the one a pending commit (an answer sent, its cache not yet
    stored) holds, and the load and prefill rate to weigh them by. A mesh asks it while routing a conversation's next turn, when
    what it heard by gossip may be older than the turn before; it answers from the digest and
    counters, not the engine's thread, so a busy engine answers at once. Another block size:
    nothing held."""
    engine = request.app.state.engine
    try:
        body = orjson.loads(await request.body())
        size, hashes = int(body["block_size"]), body["hashes"]
        if not isinstance(hashes, list) or len(hashes) > MAX_HELD_HASHES:
            raise ValueError("hashes")
        hashes = [int(h) for h in hashes]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        return _bad(f"not a prefix question: {exc}")
    held = {"memory": 0, "disk": 0, "pending": 0, "restore_tok_s": None}
    if size == engine.cache_digest.block_size:
        held = engine.prefix_held(hashes)
    stats = engine.stats
    out = {
        "block_size": size,
        "cached_tokens": max(held["memory"], held["disk"]),
        "memory_tokens": held["memory"],
        "disk_tokens": held["disk"],
        "restore_tok_s": held["restore_tok_s"],
        "pending_tokens": held["pending"],
        "queue_depth": stats.queue_depth,
        "in_flight": stats.in_flight,
        "prefill_backlog": engine.prefill_backlog,
        "prefill_tok_s": engine.prefill_tokens_per_second(),
    }
    return Response(orjson.dumps(out), media_type="application/json")
