"""OpenAI Responses requests, as the Open Responses specification's ``CreateResponseBody`` has
them: the body validated (a 400 naming the field where it is wrong) and its ``input`` items turned
into a ChatRequest. The response side is :mod:`gateway.responses.wire`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StringConstraints

from gateway.answer import new_id
from gateway.api.common import place_system_messages
from gateway.api.output_format import responses_output_format
from gateway.refusals import RequestInvalid, validated
from gateway.request import INT64_MAX, ChatRequest, Message, ToolCall
from gateway.responses.compacted import decode_history, decode_reasoning, summary_message
from gateway.responses.tools import (
    Tools,
    custom_arguments,
    flat_name,
    ignored_header,
    parse_tools,
)
from worker.chat.thinking import normalize_thinking

_TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}


class _Part(BaseModel):
    """A content part; only the text kinds are read, the others are refused by their type."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str = ""


_Content = str | list[_Part] | None


class _MessageItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: _Content = None


class _FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function_call"]
    call_id: str
    name: str
    namespace: str | None = None  # OpenAI's: the call is to a tool of a namespace tool
    arguments: str | None = None  # JSON text, as the API carries it


class _FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: _Content = ""


class _CustomToolCallItem(BaseModel):
    """OpenAI's call of a custom (freeform) tool: plain-text ``input``, no JSON."""

    model_config = ConfigDict(extra="allow")

    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    namespace: str | None = None
    input: str = ""


class _ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["reasoning"]
    content: list[_Part] | None = None
    summary: list[_Part] | None = None
    encrypted_content: str | None = Field(default=None, max_length=10 << 20)


class _CompactionItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["compaction"]
    encrypted_content: str = Field(max_length=10 << 20)


# An item's schema depends on its type, so each item is validated by the model its type names:
# errors then point at the item's own fields (``input.3.call_id``), not at every union member.
_ITEMS: dict[str, type[BaseModel]] = {
    "message": _MessageItem,
    "function_call": _FunctionCallItem,
    "function_call_output": _FunctionCallOutputItem,
    "custom_tool_call": _CustomToolCallItem,
    "custom_tool_call_output": _FunctionCallOutputItem,
    "reasoning": _ReasoningItem,
    "compaction": _CompactionItem,
}


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    name: str


class _Reasoning(BaseModel):
    model_config = ConfigDict(extra="allow")  # generate_summary (deprecated for summary)

    effort: str | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class _TextFormat(BaseModel):
    """``text.format``: the spec's three kinds; JSON ones are read by
    gateway/api/output_format.py."""

    model_config = ConfigDict(extra="allow")  # name, schema, strict, description

    type: Literal["text", "json_object", "json_schema"]


class _Text(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: _TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_obfuscation: bool | None = None  # nothing is obfuscated here: there is nothing to pad


_Key = Annotated[str, StringConstraints(max_length=64)]
# The spec's MetadataParam: at most 16 pairs, keys up to 64 characters, values up to 512.
_Metadata = Annotated[
    dict[_Key, Annotated[str, StringConstraints(max_length=512)]], Field(max_length=16)
]


class ResponsesBody(BaseModel):
    """The spec's ``CreateResponseBody``. Fields that only shape the response object (``store``,
    ``service_tier``, ``max_tool_calls``, ``include`` …) are accepted and echoed there."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None  # each validated by its type (gateway.responses.tools)
    # Hosted-tool and ``allowed_tools`` choices are refused: no such tools are served here.
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1, le=INT64_MAX)
    reasoning: _Reasoning | None = None
    text: _Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    truncation: Literal["auto", "disabled"] | None = None
    # What the response includes beyond the default: the spec's IncludeEnum. Encoded reasoning
    # is served; logprobs are accepted but stay [] (the worker does not report them).
    include: list[Literal["reasoning.encrypted_content", "message.output_text.logprobs"]] | None = (
        None
    )
    stream: bool = False
    stream_options: _StreamOptions | None = None
    store: bool | None = None
    background: bool | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    metadata: _Metadata | None = None
    user: str | None = None
    safety_identifier: _Key | None = None
    prompt_cache_key: _Key | None = None

    # Set by ``gateway.responses.stored.parse``: the id (it names the storing node), this turn's input
    # items and the stored context a ``previous_response_id`` continues.
    _response_id: str = PrivateAttr(default_factory=lambda: new_id("resp_"))
    _turn_input: list[dict[str, Any]] = PrivateAttr(default_factory=list)
    _prior_context: list[dict[str, Any]] = PrivateAttr(default_factory=list)
    # Set by ``parse``: the tools as the model sees them and how its calls go back.
    _tools: Tools = PrivateAttr(default_factory=Tools)

    @property
    def encrypted_reasoning(self) -> bool:
        """Reasoning items carry ``encrypted_content`` (encoded, see gateway.responses.compacted)."""
        return "reasoning.encrypted_content" in (self.include or ())


def _text(content: _Content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS:
            raise RequestInvalid(
                f"{where}.{j}.type: content part type {part.type!r} is not supported (text only)",
                f"{where}.{j}.type",
            )
        out.append(part.text)
    return "".join(out)


class _History:
    """Input items → chat messages. A function or custom tool call joins the assistant turn
    before it (or opens one); reasoning waits for the assistant turn it belongs to."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.pending_reasoning: str | None = None
        self._handlers: dict[type[BaseModel], Any] = {
            _MessageItem: self._message,
            _FunctionCallItem: self._call,
            _CustomToolCallItem: self._call,
            _FunctionCallOutputItem: self._output,
            _ReasoningItem: self._reasoning,
            _CompactionItem: self._compaction,
        }

    def add_raw(self, raw: dict[str, Any], where: str) -> None:
        """An input item as the client sent it: validated by the model its type names."""
        kind = raw.get("type", "message" if "role" in raw else None)
        model = _ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise RequestInvalid(
                f"{where}.type: item type {kind!r} is not supported", f"{where}.type"
            )
        self.add(validated(model, raw, where), where)

    def add(self, item: BaseModel, where: str) -> None:
        self._handlers[type(item)](item, where)

    def _message(self, item: _MessageItem, where: str) -> None:
        message = Message(
            role="system" if item.role == "developer" else item.role,
            content=_text(item.content, f"{where}.content"),
        )
        if item.role == "assistant":
            message.reasoning, self.pending_reasoning = self.pending_reasoning, None
        self.messages.append(message)

    def _call(self, item: _FunctionCallItem | _CustomToolCallItem, where: str) -> None:
        if isinstance(item, _CustomToolCallItem):
            arguments = custom_arguments(item.input)
        else:
            arguments = item.arguments or "{}"
        name = flat_name(item.namespace, item.name)
        call = ToolCall(id=item.call_id, name=name, arguments=arguments)
        last = self.messages[-1] if self.messages else None
        if last is None or last.role != "assistant":
            last = Message(role="assistant", content="")
            self.messages.append(last)
        if self.pending_reasoning is not None:
            last.reasoning, self.pending_reasoning = self.pending_reasoning, None
        last.tool_calls.append(call)

    def _output(self, item: _FunctionCallOutputItem, where: str) -> None:
        text = _text(item.output, f"{where}.output")
        self.messages.append(Message(role="tool", content=text, tool_call_id=item.call_id))

    def _compaction(self, item: _CompactionItem, where: str) -> None:
        history = decode_history(item.encrypted_content)
        if history is None:
            self.messages.append(summary_message(item.encrypted_content, where))
            return
        for k, raw in enumerate(history):  # a compaction that left the history as it was
            self.add_raw(raw, f"{where}.encrypted_content.{k}")

    def _reasoning(self, item: _ReasoningItem, where: str) -> None:
        """Readable content first, else our encoded reasoning, else the summary. Encrypted
        content from another server cannot be read here: then only the summary is left."""
        if item.content:
            self.pending_reasoning = _text(item.content, f"{where}.content")
            return
        decoded = decode_reasoning(item.encrypted_content) if item.encrypted_content else None
        if decoded is not None:
            self.pending_reasoning = decoded
        elif item.summary:
            self.pending_reasoning = _text(item.summary, f"{where}.summary")


def _input_messages(items: list[dict[str, Any]]) -> list[Message]:
    history = _History()
    for i, raw in enumerate(items):
        history.add_raw(raw, f"input.{i}")
    return history.messages


_CALLS = {"function_call", "custom_tool_call"}
_OUTPUTS = {"function_call_output", "custom_tool_call_output"}


def check_call_outputs(prior: list[dict[str, Any]], items: list[dict[str, Any]]) -> None:
    """A tool output must answer a call made before it: in ``prior`` (the previous response's
    context) or earlier in ``items`` (this request's input); else a 400 naming the item, as
    OpenAI answers. After a ``compaction`` item any output passes: the calls it answers may be
    among what the summary replaced."""
    seen = {item.get("call_id") for item in prior if item.get("type") in _CALLS}
    open_ended = any(item.get("type") == "compaction" for item in prior)
    for i, item in enumerate(items):
        kind = item.get("type")
        if kind in _CALLS:
            seen.add(item.get("call_id"))
        elif kind == "compaction":
            open_ended = True
        elif kind in _OUTPUTS and not open_ended and item.get("call_id") not in seen:
            raise RequestInvalid(
                f"input.{i}: no tool call found for {kind} with call_id {item.get('call_id')!r}",
                f"input.{i}.call_id",
            )


def parse(raw: dict[str, Any]) -> tuple[ChatRequest, ResponsesBody]:
    body = validated(ResponsesBody, raw)
    body._tools = parse_tools(body.tools)
    output_format = responses_output_format(raw)  # text.format: json_schema, json_object
    messages = [Message(role="system", content=body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        messages.append(Message(role="user", content=body.input))
    else:
        messages += _input_messages(body.input)
    choice = body.tool_choice
    tool_choice = (
        {"type": "function", "function": {"name": choice.name}}
        if isinstance(choice, FunctionChoice)
        else choice
    )
    effort = body.reasoning.effort if body.reasoning else None
    request = ChatRequest(
        model=body.model,
        messages=place_system_messages(messages),
        tools=body._tools.specs,
        tool_choice=tool_choice,
        temperature=body.temperature,
        top_p=body.top_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        max_tokens=body.max_output_tokens,
        reasoning=normalize_thinking(raw),
        reasoning_effort=effort,
        output_format=output_format,
        stream=body.stream,
        session_key=body.prompt_cache_key or body.user,
        metadata=dict(body.metadata or {}),
    )
    request.notes.update(ignored_header(body._tools))  # x-tools-ignored
    return request, body
