"""OpenAI Chat Completions: request model → ChatRequest, events → chunks / a whole completion."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway import sse
from gateway.answer import Accumulator, ToolCallState, new_id
from gateway.api.common import place_system_messages
from gateway.api.errors import openai_error_body
from gateway.api.output_format import chat_output_format
from gateway.choices import MAX_CHOICES, fan_out
from gateway.events import (
    ChoiceEvent,
    Done,
    Error,
    Event,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCallDelta,
)
from gateway.refusals import RequestInvalid, validated
from gateway.request import INT64_MAX, ChatRequest, Message, ToolCall, ToolSpec
from gateway.router import Router
from gateway.upstream import MESH_MODEL
from worker.chat.schemas import ResponseFormat, check_template_kwargs, openai_usage
from worker.chat.thinking import normalize_thinking


class _Function(BaseModel):
    name: str = ""
    arguments: str | dict[str, Any] = "{}"


class _ToolCallIn(BaseModel):
    id: str = ""
    type: str = "function"
    function: _Function


class _MessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[_ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _FunctionDef(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class _ToolIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str = "function"
    function: _FunctionDef


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


# Token id → bias added to its logit, in OpenAI's range; the worker checks the ids against its
# vocabulary and applies it.
_LogitBias = dict[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=-100, le=100)]]


class ChatCompletionBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[_MessageIn] = Field(min_length=1)
    tools: list[_ToolIn] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=0, le=INT64_MAX)
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=INT64_MAX)  # OpenAI: an int64
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: _LogitBias | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    user: str | None = None
    metadata: dict[str, Any] | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)  # choices (gateway/choices.py)
    response_format: ResponseFormat | None = None

    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 16:
            raise ValueError("at most 16 stop sequences")
        return value


def content_text(content: str | list[dict[str, Any]] | None, where: str) -> str:
    """Plain text of an OpenAI content value (string or list of text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text"):
            parts.append(str(part.get("text", "")))
        else:
            raise RequestInvalid(
                f"{where}: content part type {kind!r} is not supported (text only)", where
            )
    return "".join(parts)


def _arguments(value: str | dict[str, Any], where: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return orjson.dumps(value).decode()
    except TypeError as exc:  # nested deeper than JSON writers go: the client's mistake
        raise RequestInvalid(f"{where}: cannot be written as JSON ({exc})", where) from exc


def parse(raw: dict[str, Any]) -> tuple[ChatRequest, ChatCompletionBody]:
    body = validated(ChatCompletionBody, raw)
    messages = []
    for i, m in enumerate(body.messages):
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        messages.append(
            Message(
                role=role,  # type: ignore[arg-type]
                content=content_text(m.content, f"messages.{i}.content"),
                reasoning=m.reasoning_content or m.reasoning,
                tool_calls=[
                    ToolCall(
                        id=tc.id or new_id("call_"),
                        name=tc.function.name,
                        arguments=_arguments(
                            tc.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments"
                        ),
                    )
                    for j, tc in enumerate(m.tool_calls or [])
                ],
                tool_call_id=m.tool_call_id,
                name=m.name,
            )
        )
    _check_tool_results(body)
    _check_logprobs(body)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    request = ChatRequest(
        model=body.model,
        messages=place_system_messages(messages),
        tools=[
            ToolSpec(
                name=t.function.name,
                description=t.function.description or "",
                parameters=t.function.parameters or {"type": "object", "properties": {}},
            )
            for t in body.tools or []
        ],
        tool_choice=body.tool_choice,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        stop=stop,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=body.logit_bias or {},
        reasoning=normalize_thinking(raw),
        reasoning_effort=body.reasoning_effort,
        chat_template_kwargs=body.chat_template_kwargs or {},
        output_format=chat_output_format(body.response_format),
        stream=body.stream,
        logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs if body.logprobs else None,
        session_key=body.user,
        metadata=dict(body.metadata or {}),
    )
    return request, body


def _check_tool_results(body: ChatCompletionBody) -> None:
    """A tool message answers a tool call an earlier assistant message made, as OpenAI and
    the Responses API here require (a result the model never asked for reads as a turn of
    its own). Legacy ``function`` messages answer by name, and carry no id to check."""
    called: set[str] = set()
    for i, m in enumerate(body.messages):
        if m.role == "assistant":
            called.update(tc.id for tc in m.tool_calls or () if tc.id)
        elif m.role == "tool" and m.tool_call_id is not None and m.tool_call_id not in called:
            where = f"messages.{i}.tool_call_id"
            raise RequestInvalid(
                f"{where}: no tool call found for tool message with tool_call_id"
                f" {m.tool_call_id!r} (it must answer a tool_calls entry of an earlier"
                " assistant message)",
                where,
            )


def _check_logprobs(body: ChatCompletionBody) -> None:
    if body.top_logprobs and not body.logprobs:
        raise RequestInvalid("top_logprobs: needs logprobs: true", "top_logprobs")
    if body.logprobs and body.model == MESH_MODEL:
        # Its answer is chosen among several models' (or written by a judge): no one
        # distribution's log-probabilities describe it.
        raise RequestInvalid(
            f"logprobs: not available with model {MESH_MODEL!r} (its answer is chosen among"
            " several models'); ask a model by name",
            "logprobs",
        )


def logprobs_body(entries: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any]:
    """OpenAI's choice ``logprobs`` for these tokens. ``bytes`` is the token text's UTF-8 (a
    token that is part of a character has U+FFFD there: the worker sends text, not bytes)."""

    def entry(e: TokenLogprob) -> dict[str, Any]:
        return {"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode())}

    content = [entry(e) | {"top_logprobs": [entry(t) for t in e.top_logprobs]} for e in entries]
    return {"content": content, "refusal": None}


def error_body(error: Error) -> dict[str, Any]:
    return openai_error_body(error)


def open_stream(
    router: Router, request: ChatRequest, body: ChatCompletionBody, routes: list
) -> AsyncIterator[Event]:
    """The request's events: one routed call, or with ``n > 1`` one per choice, merged."""
    n = body.n or 1
    if n == 1:
        return router.stream(request, routes)
    return fan_out(request, n, lambda choice: router.stream(choice, routes))


def _usage_dict(acc: Accumulator) -> dict[str, Any]:
    return openai_usage(acc.prompt_tokens, acc.completion_tokens, acc.cached_tokens)


class ChatStreamEncoder:
    """Events → ``chat.completion.chunk`` frames; ``[DONE]`` after the terminal one."""

    def __init__(self, request: ChatRequest, body: ChatCompletionBody) -> None:
        self.id = new_id("chatcmpl-")
        self.created = int(time.time())
        self.model = request.model
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.logprobs = request.logprobs
        self.acc = Accumulator()
        self._role_sent: set[int] = set()  # the choices whose first chunk went out

    def start(self) -> bytes:
        return b""

    def keepalive(self) -> bytes:
        return sse.KEEPALIVE

    def _chunk(
        self,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        if index not in self._role_sent:
            delta = {"role": "assistant", **delta}
            self._role_sent.add(index)
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        return sse.data_frame(
            {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
            }
        )

    def _delta(self, event: Event, opened: ToolCallState | None, index: int) -> bytes:
        if isinstance(event, TextDelta):
            logprobs = logprobs_body(event.logprobs or ()) if self.logprobs else None
            return self._chunk({"content": event.text}, index=index, logprobs=logprobs)
        if isinstance(event, ReasoningDelta):
            return self._chunk({"reasoning_content": event.text}, index=index)
        if isinstance(event, ToolCallDelta):
            if opened is not None:
                call = {
                    "index": event.index,
                    "id": opened.id,
                    "type": "function",
                    "function": {"name": opened.name, "arguments": event.arguments},
                }
            else:
                call = {"index": event.index, "function": {"arguments": event.arguments}}
            return self._chunk({"tool_calls": [call]}, index=index)
        # Usage is folded into the accumulator; Meta is for headers; a Progress note has no
        # channel here (it must not show up as text or reasoning before the answer).
        return b""

    def encode(self, event: Event) -> bytes:
        opened = self.acc.add(event)
        if isinstance(event, ChoiceEvent):  # n > 1: each choice ends on its own
            if isinstance(event.event, Done):
                finish = self.acc.choices[event.index].finish_reason
                return self._chunk({}, finish, event.index)
            return self._delta(event.event, opened, event.index)
        if isinstance(event, Done):
            out = b"" if self.acc.choices else self._chunk({}, self.acc.finish_reason)
            if self.include_usage:
                out += sse.data_frame(
                    {
                        "id": self.id,
                        "object": "chat.completion.chunk",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": _usage_dict(self.acc),
                    }
                )
            return out + sse.DONE
        if isinstance(event, Error):
            return sse.data_frame(error_body(event)) + sse.DONE
        return self._delta(event, opened, 0)


def completion_body(request: ChatRequest, acc: Accumulator) -> dict[str, Any]:
    choices = sorted(acc.choices.items()) if acc.choices else [(0, acc)]
    return {
        "id": new_id("chatcmpl-"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [_choice_body(index, c, request.logprobs) for index, c in choices],
        "usage": _usage_dict(acc),
    }


def _choice_body(index: int, acc: Accumulator, logprobs: bool) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": acc.text if acc.text or not acc.tool_calls else None,
    }
    if acc.reasoning:
        message["reasoning_content"] = acc.reasoning
    if acc.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in acc.tool_calls.values()
        ]
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs_body(acc.logprobs) if logprobs else None,
        "finish_reason": acc.finish_reason or "stop",
    }
