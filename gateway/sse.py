"""Server-sent-event frame builders. Every frame is built whole so it is written in one chunk."""

from __future__ import annotations

from typing import Any

import orjson

KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"

SSE_HEADERS: dict[str, str] = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    "x-accel-buffering": "no",
}


def data_frame(payload: Any) -> bytes:
    """``data: <json>`` – the OpenAI Chat Completions framing."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def named_frame(event: str, payload: Any) -> bytes:
    """``event: <name>`` + ``data: <json>`` – Responses and Anthropic Messages framing."""
    return encoded_frame(event, orjson.dumps(payload))


def encoded_frame(event: str, data: bytes) -> bytes:
    """A named frame around JSON that is already encoded (one line: orjson never breaks it)."""
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"
