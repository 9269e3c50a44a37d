"""OpenAI Responses: ``input`` items → ChatRequest; events → typed stream events / a response.

Output is a list of items opened and closed in order (reasoning, message, function_call); every
event carries a ``sequence_number``; one response id throughout. A ``Progress`` note becomes a
reasoning item with a summary (no content): the one place a client may see it before the answer.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from gateway import sse
from gateway.answer import Accumulator, clamp_tool_name, new_id
from gateway.api.common import place_system_messages
from gateway.api.compacted import summary_message
from gateway.api.errors import RequestInvalid, openai_error_body, validated
from gateway.events import Done, Error, Event, Progress, ReasoningDelta, TextDelta, ToolCallDelta
from gateway.request import INT64_MAX, ChatRequest, Message, ToolCall, ToolSpec
from worker.thinking import normalize_thinking

_EFFORTS = {"none", "minimal", "low", "medium", "high", "xhigh", "max"}
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
    arguments: str | None = None  # JSON text, as the API carries it


class _FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function_call_output"]
    call_id: str
    output: _Content = ""


class _ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["reasoning"]
    content: list[_Part] | None = None
    summary: list[_Part] | None = None


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
    "reasoning": _ReasoningItem,
    "compaction": _CompactionItem,
}


class _ToolIn(BaseModel):
    """A tool; only ``function`` tools are served, other types are refused after validation."""

    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    name: str


class _Reasoning(BaseModel):
    model_config = ConfigDict(extra="allow")  # summary, generate_summary

    effort: str | None = None


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[_ToolIn] | None = None
    # Hosted-tool and ``allowed_tools`` choices are refused: no such tools are served here.
    tool_choice: Literal["none", "auto", "required"] | _FunctionChoice | None = None
    reasoning: _Reasoning | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    previous_response_id: str | None = None
    store: bool = True

    # Set by ``stored_responses.parse``: the id (it names the storing node), this turn's input
    # items and the stored context a ``previous_response_id`` continues.
    _response_id: str = PrivateAttr(default_factory=lambda: new_id("resp_"))
    _turn_input: list[dict[str, Any]] = PrivateAttr(default_factory=list)
    _prior_context: list[dict[str, Any]] = PrivateAttr(default_factory=list)


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


def _input_messages(items: list[dict[str, Any]]) -> list[Message]:
    out: list[Message] = []
    pending_reasoning: str | None = None
    for i, raw in enumerate(items):
        where = f"input.{i}"
        kind = raw.get("type", "message" if "role" in raw else None)
        model = _ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise RequestInvalid(
                f"{where}.type: item type {kind!r} is not supported", f"{where}.type"
            )
        item = validated(model, raw, where)
        if isinstance(item, _MessageItem):
            message = Message(
                role="system" if item.role == "developer" else item.role,
                content=_text(item.content, f"{where}.content"),
            )
            if item.role == "assistant" and pending_reasoning is not None:
                message.reasoning, pending_reasoning = pending_reasoning, None
            out.append(message)
        elif isinstance(item, _FunctionCallItem):
            call = ToolCall(id=item.call_id, name=item.name, arguments=item.arguments or "{}")
            last = out[-1] if out else None
            if last is None or last.role != "assistant":
                last = Message(role="assistant", content="")
                out.append(last)
            if pending_reasoning is not None:
                last.reasoning, pending_reasoning = pending_reasoning, None
            last.tool_calls.append(call)
        elif isinstance(item, _FunctionCallOutputItem):
            text = _text(item.output, f"{where}.output")
            out.append(Message(role="tool", content=text, tool_call_id=item.call_id))
        elif isinstance(item, _CompactionItem):
            out.append(summary_message(item.encrypted_content, where))
        elif isinstance(item, _ReasoningItem):
            field = "content" if item.content else "summary"
            pending_reasoning = _text(item.content or item.summary, f"{where}.{field}")
    return out


def parse(raw: dict[str, Any]) -> tuple[ChatRequest, ResponsesBody]:
    body = validated(ResponsesBody, raw)
    messages = [Message(role="system", content=body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        messages.append(Message(role="user", content=body.input))
    else:
        messages += _input_messages(body.input)
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.type != "function" or not tool.name:
            raise RequestInvalid(
                f"tools.{i}: only function tools with a name are supported", f"tools.{i}"
            )
        tools.append(
            ToolSpec(
                name=tool.name,
                description=tool.description or "",
                parameters=tool.parameters or {"type": "object", "properties": {}},
            )
        )
    choice = body.tool_choice
    tool_choice = (
        {"type": "function", "function": {"name": choice.name}}
        if isinstance(choice, _FunctionChoice)
        else choice
    )
    effort = body.reasoning.effort if body.reasoning else None
    request = ChatRequest(
        model=body.model,
        messages=place_system_messages(messages),
        tools=tools,
        tool_choice=tool_choice,
        temperature=body.temperature,
        top_p=body.top_p,
        max_tokens=body.max_output_tokens,
        reasoning=normalize_thinking(raw),
        reasoning_effort=effort,
        stream=body.stream,
        session_key=body.prompt_cache_key or body.user,
        metadata=dict(body.metadata or {}),
    )
    return request, body


def error_body(error: Error) -> dict[str, Any]:
    return openai_error_body(error)


def _usage(acc: Accumulator) -> dict[str, Any]:
    return {
        "input_tokens": acc.prompt_tokens,
        "input_tokens_details": {"cached_tokens": acc.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": acc.completion_tokens,
        "output_tokens_details": {
            "reasoning_tokens": min(acc.reasoning_deltas, acc.completion_tokens)
        },
        "total_tokens": acc.prompt_tokens + acc.completion_tokens,
    }


class _Shell:
    """The response object's fixed fields, echoed from the request; ``temperature`` and
    ``top_p`` become the values used once the upstream said them (``Sampling``)."""

    def __init__(self, request: ChatRequest, body: ResponsesBody) -> None:
        self.id = body._response_id
        self.created_at = int(time.time())
        choice: Any = body.tool_choice or "auto"
        if isinstance(choice, _FunctionChoice):
            choice = {"type": "function", "name": choice.name}
        effort = body.reasoning.effort if body.reasoning else None
        self.fields: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": request.model,
            "instructions": body.instructions,
            "metadata": body.metadata or {},
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": True,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": choice,
            "tools": [
                {
                    "type": "function",
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                    "strict": None,
                }
                for t in request.tools
            ],
            "reasoning": {"effort": effort if effort in _EFFORTS else None, "summary": None},
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
        }

    def response(
        self, status: str, output: list[dict[str, Any]], acc: Accumulator | None = None
    ) -> dict[str, Any]:
        out = dict(
            self.fields,
            status=status,
            output=output,
            error=None,
            incomplete_details=None,
            usage=None,
        )
        if acc is not None:
            out["usage"] = _usage(acc)
            if acc.sampling is not None:
                out["temperature"] = acc.sampling.temperature
                out["top_p"] = acc.sampling.top_p
            if status == "incomplete":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
            if acc.error is not None:
                code = "rate_limit_exceeded" if acc.error.kind == "overloaded" else "server_error"
                out["error"] = {"code": code, "message": acc.error.message}
            if status != "in_progress":
                out["completed_at"] = int(time.time())
        return out


class ResponsesStreamEncoder:
    """Events → Responses stream events, one open output item at a time."""

    def __init__(self, request: ChatRequest, body: ResponsesBody) -> None:
        self.shell = _Shell(request, body)
        self.acc = Accumulator()
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.item: dict[str, Any] | None = None  # the open item
        self.item_kind = ""
        self.item_parts: list[str] = []
        self.item_index = -1
        self.tool_index: int | None = None
        self.final: dict[str, Any] | None = None  # the response object, once terminal

    def _event(self, kind: str, payload: dict[str, Any]) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **payload}
        self.seq += 1
        return sse.named_frame(kind, payload)

    def keepalive(self) -> bytes:
        return sse.KEEPALIVE

    def start(self) -> bytes:
        empty = self.shell.response("in_progress", [])
        return self._event("response.created", {"response": empty}) + self._event(
            "response.in_progress", {"response": empty}
        )

    def _open(self, kind: str, item: dict[str, Any]) -> bytes:
        out = self._close()
        self.item, self.item_kind = item, kind
        self.item_parts: list[str] = []  # the open message/reasoning item's text so far
        self.item_index = len(self.output)
        out += self._event(
            "response.output_item.added", {"output_index": self.item_index, "item": item}
        )
        where = {"item_id": item["id"], "output_index": self.item_index, "content_index": 0}
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._event("response.content_part.added", {**where, "part": part})
        elif kind == "reasoning":
            out += self._event(
                "response.content_part.added",
                {**where, "part": {"type": "reasoning_text", "text": ""}},
            )
        elif kind == "summary":
            out += self._event(
                "response.reasoning_summary_part.added",
                {**self._summary_where(item), "part": _summary_part("")},
            )
        return out

    def _summary_where(self, item: dict[str, Any]) -> dict[str, Any]:
        """Where the open summary item's one summary part is (progress notes all append to it)."""
        return {"item_id": item["id"], "output_index": self.item_index, "summary_index": 0}

    def _close(self, status: str = "completed") -> bytes:
        item = self.item
        if item is None:
            return b""
        self.item = None
        index = self.item_index
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        out = b""
        done = dict(item, status=status)
        if self.item_kind == "message":
            text = "".join(self.item_parts)
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out += self._event("response.output_text.done", {**where, "text": text, "logprobs": []})
            out += self._event("response.content_part.done", {**where, "part": part})
            done["content"] = [part]
        elif self.item_kind == "reasoning":
            text = "".join(self.item_parts)
            part = {"type": "reasoning_text", "text": text}
            out += self._event("response.reasoning_text.done", {**where, "text": text})
            out += self._event("response.content_part.done", {**where, "part": part})
            done["content"] = [part]
        elif self.item_kind == "summary":
            out += self._close_summary(item, status)
            done["summary"] = [_summary_part("".join(self.item_parts))]
        else:
            out += self._event(
                "response.function_call_arguments.done",
                {
                    "item_id": item["id"],
                    "output_index": index,
                    "arguments": item["arguments"],
                    "name": item["name"],
                },
            )
        out += self._event("response.output_item.done", {"output_index": index, "item": done})
        self.output.append(done)
        return out

    def _close_summary(self, item: dict[str, Any], status: str) -> bytes:
        text = "".join(self.item_parts)
        where = self._summary_where(item)
        part_done = {**where, "part": _summary_part(text)}
        if status == "incomplete":  # the response failed while the note was still open
            part_done["status"] = "incomplete"
        out = self._event("response.reasoning_summary_text.done", {**where, "text": text})
        return out + self._event("response.reasoning_summary_part.done", part_done)

    def _progress(self, text: str) -> bytes:
        """A progress note: appended to the open summary item, else opening one."""
        out = b""
        item = self.item
        if self.item_kind != "summary" or item is None:
            item = {
                "id": new_id("rs_"),
                "type": "reasoning",
                "summary": [],
                "status": "in_progress",
            }
            out = self._open("summary", item)
        self.item_parts.append(text)
        delta = {**self._summary_where(item), "delta": text}
        return out + self._event("response.reasoning_summary_text.delta", delta)

    def _content_delta(
        self, kind: str, item: dict, event_type: str, payload: dict, text: str
    ) -> bytes:
        """One text or reasoning delta, opening its output item first when it is not the open one."""
        out = b""
        if self.item_kind != kind or self.item is None:
            out = self._open(kind, {**item, "status": "in_progress", "content": []})
        self.item_parts.append(text)
        where = {"item_id": self.item["id"], "output_index": self.item_index, "content_index": 0}  # type: ignore[index]
        return out + self._event(event_type, {**where, **payload})

    def encode(self, event: Event) -> bytes:
        opened = self.acc.add(event)
        if isinstance(event, TextDelta):
            return self._content_delta(
                "message",
                {"id": new_id("msg_"), "type": "message", "role": "assistant"},
                "response.output_text.delta",
                {"delta": event.text, "logprobs": []},
                event.text,
            )
        if isinstance(event, ReasoningDelta):
            return self._content_delta(
                "reasoning",
                {"id": new_id("rs_"), "type": "reasoning", "summary": []},
                "response.reasoning_text.delta",
                {"delta": event.text},
                event.text,
            )
        if isinstance(event, Progress):
            return self._progress(event.text)
        if isinstance(event, ToolCallDelta):
            out = b""
            if (
                opened is not None
                or self.item_kind != "function_call"
                or self.item is None
                or self.tool_index != event.index
            ):
                call = opened or self.acc.tool_calls[event.index]
                self.tool_index = event.index
                out = self._open(
                    "function_call",
                    {
                        "id": new_id("fc_"),
                        "type": "function_call",
                        "status": "in_progress",
                        "call_id": call.id,
                        "name": clamp_tool_name(call.name),
                        "arguments": "",
                    },
                )
            if not event.arguments:
                return out
            self.item["arguments"] += event.arguments  # type: ignore[index]
            payload = {
                "item_id": self.item["id"],
                "output_index": self.item_index,
                "delta": event.arguments,
            }  # type: ignore[index]
            return out + self._event("response.function_call_arguments.delta", payload)
        if isinstance(event, Done):
            incomplete = self.acc.finish_reason == "length"
            out = self._close("incomplete" if incomplete else "completed")
            status = "incomplete" if incomplete else "completed"
            final = self.shell.response(status, self.output, self.acc)
            self.final = final
            return out + self._event(f"response.{status}", {"response": final})
        if isinstance(event, Error):
            out = self._close("incomplete")
            code = "rate_limit_exceeded" if event.kind == "overloaded" else "server_error"
            out += self._event("error", {"code": code, "message": event.message, "param": None})
            self.final = self.shell.response("failed", self.output, self.acc)
            return out + self._event("response.failed", {"response": self.final})
        return b""


def response_body(request: ChatRequest, body: ResponsesBody, acc: Accumulator) -> dict[str, Any]:
    """The whole response object for a non-streaming call."""
    output: list[dict[str, Any]] = []
    incomplete = acc.finish_reason == "length"
    status = "incomplete" if incomplete else "completed"
    if acc.progress:
        summary = [_summary_part(acc.progress)]
        output.append(
            {"id": new_id("rs_"), "type": "reasoning", "summary": summary, "status": status}
        )
    if acc.reasoning:
        output.append(
            {
                "id": new_id("rs_"),
                "type": "reasoning",
                "summary": [],
                "status": status,
                "content": [{"type": "reasoning_text", "text": acc.reasoning}],
            }
        )
    if acc.text or not acc.tool_calls:
        part = {"type": "output_text", "text": acc.text, "annotations": [], "logprobs": []}
        output.append(
            {
                "id": new_id("msg_"),
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": [part],
            }
        )
    for call in acc.tool_calls.values():
        output.append(
            {
                "id": new_id("fc_"),
                "type": "function_call",
                "status": status,
                "call_id": call.id,
                "name": call.name,
                "arguments": call.arguments,
            }
        )
    return _Shell(request, body).response(status, output, acc)


def _summary_part(text: str) -> dict[str, Any]:
    return {"type": "summary_text", "text": text}
