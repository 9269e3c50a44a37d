"""Anthropic Messages requests: the body's content blocks → one ``ChatRequest``.

The answer's side (events → named SSE events, or one message) is ``messages_sse.py``.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.answer import new_id
from gateway.api.common import place_system_messages
from gateway.api.output_format import messages_effort, messages_output_format
from gateway.refusals import RequestInvalid, validated
from gateway.request import INT64_MAX, ChatRequest, Message, ToolCall, ToolSpec
from worker.chat.thinking import normalize_thinking


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
    """A Messages body as count_tokens takes it: every field checked as Messages checks it (as
    Anthropic's does), ``max_tokens`` optional (nothing is generated). Strict, as Anthropic's
    API is: ``"stream": "yes"`` or ``"max_tokens": "5"`` is a 400, not a guess."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: _ToolChoice | None = None
    thinking: _Thinking | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=0, le=INT64_MAX)
    stream: bool = False
    metadata: dict[str, Any] | None = None


class MessagesBody(ConversationBody):
    max_tokens: int = Field(ge=1, le=INT64_MAX)


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
    _check_tool_results(body.messages)
    return place_system_messages(messages)


def _check_tool_results(messages: list[MessageIn]) -> None:
    """A tool_result answers a tool_use block of an earlier assistant message, as Anthropic's
    API and the Responses API here require (a result the model never asked for reads as a
    turn of its own). Runs after the blocks were checked: their types are right."""
    used: set[str] = set()
    for i, m in enumerate(messages):
        for j, block in enumerate(m.content if isinstance(m.content, list) else ()):
            kind = block.get("type")
            if kind == "tool_use" and m.role == "assistant" and block.get("id"):
                used.add(block["id"])
            elif kind == "tool_result" and block.get("tool_use_id") not in used:
                where = f"messages.{i}.content.{j}.tool_use_id"
                raise RequestInvalid(
                    f"{where}: unexpected tool_use_id {block.get('tool_use_id')!r} in a"
                    " tool_result block: each tool_result must answer a tool_use block of an"
                    " earlier assistant message",
                    where,
                )


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
    return request_of(body, raw), body


def request_of(body: ConversationBody, raw: dict[str, Any]) -> ChatRequest:
    """The request a validated body asks for (``raw``: its knobs read at the edge – thinking,
    effort, output format – which are checked here too)."""
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
    return request
