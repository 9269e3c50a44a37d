"""OpenAI Responses: events → typed stream events / a response (requests are parsed in
:mod:`gateway.api.responses_input`).

Output is a list of items opened and closed in order (reasoning, message, function_call); every
event carries a ``sequence_number``; one response id throughout. A ``Progress`` note becomes a
reasoning item with a summary (no content): the one place a client may see it before the answer.
"""

from __future__ import annotations

import time
from typing import Any

from gateway import sse
from gateway.answer import Accumulator, clamp_tool_name, new_id
from gateway.api.errors import openai_error_body
from gateway.api.responses_input import FunctionChoice, ResponsesBody, parse
from gateway.events import Done, Error, Event, Progress, ReasoningDelta, TextDelta, ToolCallDelta
from gateway.request import ChatRequest

__all__ = ["ResponsesBody", "ResponsesStreamEncoder", "error_body", "parse", "response_body"]

_EFFORTS = {"none", "minimal", "low", "medium", "high", "xhigh", "max"}


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
        self.id = new_id("resp_")
        self.created_at = int(time.time())
        choice: Any = body.tool_choice or "auto"
        if isinstance(choice, FunctionChoice):
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
            return out + self._event(f"response.{status}", {"response": final})
        if isinstance(event, Error):
            out = self._close("incomplete")
            code = "rate_limit_exceeded" if event.kind == "overloaded" else "server_error"
            out += self._event("error", {"code": code, "message": event.message, "param": None})
            return out + self._event(
                "response.failed",
                {"response": self.shell.response("failed", self.output, self.acc)},
            )
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
