"""Anthropic Messages: content blocks → ChatRequest; events → named SSE events / a message.

Blocks are opened and closed in order (thinking, text, tool_use); ``message_delta`` carries the
stop reason and usage; ``message_stop`` ends the stream; ``event: error`` ends a failed one.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway import sse
from gateway.answer import Accumulator, clamp_tool_name, new_id
from gateway.api.common import place_system_messages
from gateway.api.errors import RequestInvalid, anthropic_error_body, validated
from gateway.api.output_format import messages_effort, messages_output_format
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
from gateway.request import INT64_MAX, ChatRequest, Message, ToolCall, ToolSpec
from worker.thinking import normalize_thinking

_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}


class _TextBlock(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, citations

    type: Literal["text"]
    text: str


class _ThinkingBlock(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class _RedactedThinkingBlock(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["redacted_thinking"]
    data: str | None = None


class _ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["tool_use"]
    id: str | None = None
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class _ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["tool_result"]
    tool_use_id: str
    # The API takes a string or a list of content blocks; of those, text is what we read.
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False


# A block's schema depends on its type, so each block is validated by the model its type names
# (errors name the block's own field, ``messages.2.content.0.content``); which types a turn may
# hold depends on its role.
_BLOCKS: dict[str, type[BaseModel]] = {
    "text": _TextBlock,
    "thinking": _ThinkingBlock,
    "redacted_thinking": _RedactedThinkingBlock,
    "tool_use": _ToolUseBlock,
    "tool_result": _ToolResultBlock,
}
_TEXT_ONLY = ("text",)
_ALLOWED_BLOCKS = {
    "assistant": ("text", "thinking", "redacted_thinking", "tool_use"),
    "user": ("text", "tool_result"),
    "system": _TEXT_ONLY,
}


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class ToolIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )


class _ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")  # disable_parallel_tool_use

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None

    @model_validator(mode="after")
    def _named(self) -> _ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("a tool_choice of type 'tool' needs the tool's name")
        return self


class _Thinking(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0)


class ConversationBody(BaseModel):
    """What Messages and count_tokens both take: the conversation, its tools and thinking."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[MessageIn]
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: _ToolChoice | None = None
    thinking: _Thinking | None = None


class MessagesBody(ConversationBody):
    max_tokens: int = Field(ge=1, le=INT64_MAX)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=0, le=INT64_MAX)
    stream: bool = False
    metadata: dict[str, Any] | None = None


def _blocks(content: list[dict[str, Any]], allowed: tuple[str, ...], where: str) -> list[Any]:
    """Each block of ``content`` validated by the model its type names; other types are 400."""
    out = []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind not in allowed:
            raise RequestInvalid(
                f"{where}.{j}.type: {kind!r} is not supported here ({', '.join(allowed)})",
                f"{where}.{j}.type",
            )
        out.append(validated(_BLOCKS[kind], block, f"{where}.{j}"))
    return out


# What a text-only model reads instead of an image a tool returned (Claude Code's Read on a
# PNG): refusing it would poison the session for good, the image staying in its history.
IMAGE_PLACEHOLDER = "[image omitted: this model reads text only]"
_REPLACEABLE = ("image", "document")


def _tool_result_text(
    content: str | list[dict[str, Any]], where: str, notes: dict[str, int]
) -> str:
    """A tool result's text, its image blocks replaced by a placeholder (counted in notes)."""
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(content):
        if block.get("type") in _REPLACEABLE:
            notes["tool_result_image"] = notes.get("tool_result_image", 0) + 1
            parts.append(IMAGE_PLACEHOLDER)
        elif block.get("type") == "text":
            parts.append(validated(_TextBlock, block, f"{where}.{j}").text)
        else:
            raise RequestInvalid(
                f"{where}.{j}.type: {block.get('type')!r} is not supported here (text, image)",
                f"{where}.{j}.type",
            )
    return "\n".join(parts)


def _blocks_text(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    return "".join(block.text for block in _blocks(content, _TEXT_ONLY, where))


def _convert_message(m: MessageIn, where: str, notes: dict[str, int]) -> list[Message]:  # noqa: C901 - to be split (complexity gate, issue 10)
    """One Anthropic message → our turns (a user turn with tool_result blocks → tool turns)."""
    if isinstance(m.content, str):
        return [Message(role=m.role, content=m.content)]
    blocks = _blocks(m.content, _ALLOWED_BLOCKS[m.role], f"{where}.content")
    if m.role == "system":
        return [Message(role="system", content="".join(b.text for b in blocks))]
    if m.role == "assistant":
        turn = Message(role="assistant", content="")
        for block in blocks:
            if isinstance(block, _TextBlock):
                turn.content += block.text
            elif isinstance(block, _ThinkingBlock):
                turn.reasoning = (turn.reasoning or "") + block.thinking
            elif isinstance(block, _ToolUseBlock):
                turn.tool_calls.append(
                    ToolCall(
                        id=block.id or new_id("toolu_"),
                        name=block.name,
                        arguments=orjson.dumps(block.input).decode(),
                    )
                )
        return [turn]
    out: list[Message] = []
    text: list[str] = []
    for j, block in enumerate(blocks):
        if isinstance(block, _TextBlock):
            text.append(block.text)
            continue
        if text:
            out.append(Message(role="user", content="".join(text)))
            text = []
        result = _tool_result_text(block.content, f"{where}.content.{j}.content", notes)
        if block.is_error:
            result = f"Error: {result}"
        out.append(Message(role="tool", content=result, tool_call_id=block.tool_use_id))
    if text or not out:
        out.append(Message(role="user", content="".join(text)))
    return out


# System blocks that are client metadata, not instructions: Claude Code's first block is
# ``x-anthropic-billing-header: cc_version=…; cc_entrypoint=…;``, different every session. At the
# very start of the prompt it would make every new session miss the shared prefix in the cache.
_CLIENT_METADATA = ("x-anthropic-billing-header:",)


def system_text(system: str | list[dict[str, Any]]) -> str:
    """The system prompt: its blocks joined by a blank line, client metadata left out."""
    if isinstance(system, str):
        return system
    blocks = _blocks(system, _TEXT_ONLY, "system")
    kept = [b.text for b in blocks if not b.text.lstrip().startswith(_CLIENT_METADATA)]
    return "\n\n".join(kept)


def messages_of(body: ConversationBody, notes: dict[str, int] | None = None) -> list[Message]:
    """The turns of a Messages-shaped body (also used by count_tokens); ``notes`` counts what
    was replaced on the way (image blocks in tool results)."""
    notes = {} if notes is None else notes
    messages: list[Message] = []
    system = system_text(body.system) if body.system else ""
    if system:
        messages.append(Message(role="system", content=system))
    for i, m in enumerate(body.messages):
        messages += _convert_message(m, f"messages.{i}", notes)
    return place_system_messages(messages)


def tools_of(body: ConversationBody) -> list[ToolSpec]:
    return [
        ToolSpec(name=t.name, description=t.description or "", parameters=t.input_schema)
        for t in body.tools or []
    ]


def tool_choice_of(body: ConversationBody) -> str | dict[str, Any] | None:
    choice = body.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def parse(raw: dict[str, Any]) -> tuple[ChatRequest, MessagesBody]:
    body = validated(MessagesBody, raw)
    metadata = dict(body.metadata or {})
    replaced: dict[str, int] = {}
    request = ChatRequest(
        model=body.model,
        messages=messages_of(body, replaced),
        tools=tools_of(body),
        tool_choice=tool_choice_of(body),
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        max_tokens=body.max_tokens,
        stop=list(body.stop_sequences or []),
        reasoning=normalize_thinking(raw),
        reasoning_effort=messages_effort(raw),
        output_format=messages_output_format(raw),
        stream=body.stream,
        session_key=str(metadata["user_id"]) if metadata.get("user_id") else None,
        metadata=metadata,
    )
    if replaced:
        images = replaced["tool_result_image"]
        request.notes["x-content-replaced"] = f"{images} tool_result image(s): text-only model"
    return request, body


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
        message = {
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
