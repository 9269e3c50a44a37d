"""Anthropic Messages answers: events → named SSE events, or one message body.

Blocks are opened and closed in order (thinking, text, tool_use); ``message_delta`` carries the
stop reason and usage; ``message_stop`` ends the stream; ``event: error`` ends a failed one.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from gateway import sse
from gateway.answer import Accumulator, clamp_tool_name, new_id
from gateway.api.errors import anthropic_error_body
from gateway.api.messages import MessagesBody
from gateway.events import (
    Done,
    Error,
    Event,
    Meta,
    Progress,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
)
from gateway.request import ChatRequest

_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}


def error_body(error: Error) -> dict[str, Any]:
    return anthropic_error_body(error)


def _signature(thinking: str) -> str:
    # Not a cryptographic attestation: a stable digest so clients that echo blocks back work.
    return hashlib.sha256(thinking.encode()).hexdigest()


def _usage(acc: Accumulator) -> dict[str, Any]:
    return {
        "input_tokens": acc.prompt_tokens - acc.cached_tokens,
        "output_tokens": acc.completion_tokens,
        "cache_read_input_tokens": acc.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _stop_reason(acc: Accumulator) -> str:
    if acc.stop_sequence is not None:
        return "stop_sequence"
    return _STOP_REASONS.get(acc.finish_reason or "stop", "end_turn")


class MessagesStreamEncoder:
    def __init__(self, request: ChatRequest, body: MessagesBody) -> None:
        self.id = new_id("msg_")
        self.model = request.model
        self.acc = Accumulator()
        self.index = -1
        self.kind = ""  # kind of the open block, "" when none
        self.tool_index: int | None = None
        self.thinking: list[str] = []  # the open thinking block's text, for its signature
        self.started = False  # message_start went out

    def keepalive(self) -> bytes:
        # Pings may come before message_start (the SDKs skip them wherever they are).
        return sse.named_frame("ping", {"type": "ping"})

    def start(self) -> bytes:
        # message_start waits for the first event: upstreams that know the prompt's size send
        # it (an early Usage) right before the first delta, and clients read input_tokens there.
        return b""

    def _message_start(self) -> bytes:
        self.started = True
        usage = (
            _usage(self.acc)
            if self.acc.usage is not None
            else {"input_tokens": 0, "output_tokens": 0}
        )
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return sse.named_frame("message_start", {"type": "message_start", "message": message})

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.index += 1
        self.kind = kind
        return out + sse.named_frame(
            "content_block_start",
            {"type": "content_block_start", "index": self.index, "content_block": block},
        )

    def _close(self) -> bytes:
        if not self.kind:
            return b""
        out = b""
        if self.kind == "thinking":
            delta = {"type": "signature_delta", "signature": _signature("".join(self.thinking))}
            out += self._delta(delta)
            self.thinking = []
        self.kind = ""
        return out + sse.named_frame(
            "content_block_stop", {"type": "content_block_stop", "index": self.index}
        )

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse.named_frame(
            "content_block_delta",
            {"type": "content_block_delta", "index": self.index, "delta": delta},
        )

    def encode(self, event: Event) -> bytes:
        if isinstance(event, Progress | Meta):
            # No summary channel in Messages; nor does a note or a route fact (headers) start
            # the message: message_start should carry the prompt count of an early Usage that
            # may still come.
            return b""
        frames = self._encode(event)  # folds ``event`` in first: an early Usage is known here
        if self.started or isinstance(event, Error):  # a failure needs no message around it
            return frames
        return self._message_start() + frames

    def _encode(self, event: Event) -> bytes:
        opened = self.acc.add(event)
        if isinstance(event, TextDelta):
            out = b"" if self.kind == "text" else self._open("text", {"type": "text", "text": ""})
            return out + self._delta({"type": "text_delta", "text": event.text})
        if isinstance(event, ReasoningDelta):
            out = (
                b""
                if self.kind == "thinking"
                else self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            )
            self.thinking.append(event.text)
            return out + self._delta({"type": "thinking_delta", "thinking": event.text})
        if isinstance(event, ToolCallDelta):
            out = b""
            if opened is not None or self.kind != "tool_use" or self.tool_index != event.index:
                call = opened or self.acc.tool_calls[event.index]
                self.tool_index = event.index
                block = {
                    "type": "tool_use",
                    "id": call.id,
                    "name": clamp_tool_name(call.name),
                    "input": {},
                }
                out = self._open("tool_use", block)
            if event.arguments:
                out += self._delta({"type": "input_json_delta", "partial_json": event.arguments})
            return out
        if isinstance(event, Done):
            out = self._close()
            delta = {
                "type": "message_delta",
                "delta": {
                    "stop_reason": _stop_reason(self.acc),
                    "stop_sequence": self.acc.stop_sequence,
                },
                "usage": _usage(self.acc),
            }
            return (
                out
                + sse.named_frame("message_delta", delta)
                + sse.named_frame("message_stop", {"type": "message_stop"})
            )
        if isinstance(event, Error):
            return sse.named_frame("error", error_body(event))
        return b""


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {"_raw_arguments": arguments}  # keep the model's output rather than drop the call
    return value if isinstance(value, dict) else {"value": value}


def message_body(request: ChatRequest, body: MessagesBody, acc: Accumulator) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if acc.reasoning:
        content.append(
            {"type": "thinking", "thinking": acc.reasoning, "signature": _signature(acc.reasoning)}
        )
    if acc.text:
        content.append({"type": "text", "text": acc.text})
    for call in acc.tool_calls.values():
        content.append(
            {
                "type": "tool_use",
                "id": call.id,
                "name": call.name,
                "input": _tool_input(call.arguments),
            }
        )
    return {
        "id": new_id("msg_"),
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": request.model,
        "stop_reason": _stop_reason(acc),
        "stop_sequence": acc.stop_sequence,
        "usage": _usage(acc),
    }
