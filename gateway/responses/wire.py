"""The Responses API on the wire, as the Open Responses specification has it: internal events →
stream events, the whole response body, and the error body. With ``parse`` (from
:mod:`gateway.responses.request`, re-exported) it is all the shared request lifetime plugs in.

Output is a list of items opened and closed in order (reasoning, message, function_call); every
event carries a ``sequence_number``; one response id throughout. A ``Progress`` note becomes a
reasoning item with a summary (no content): the one place a client may see it before the answer.

The response object and every stream event match the vendored spec
(``tests/fixtures/openresponses``); where it and OpenAI's API differ, the spec wins: raw reasoning
streams as ``response.reasoning.delta``/``.done``, and the ``error`` event nests its payload. The
encoder makes event dicts first and frames them second, so SSE and a WebSocket (one JSON message
per event) share it.

Tool calls go back under the client's names for its tools (gateway.responses.tools): a
namespaced tool's call carries OpenAI's ``namespace`` field, a custom tool's is OpenAI's
``custom_tool_call`` item – both beyond the spec, and only for clients that declared such tools.
With ``include: ["reasoning.encrypted_content"]`` reasoning items carry ``encrypted_content``
(encoded, not encrypted: gateway.responses.compacted).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway import sse
from gateway.answer import Accumulator, ToolCallState, new_id
from gateway.api.errors import openai_error_body
from gateway.events import Done, Error, Event, Progress, ReasoningDelta, TextDelta, ToolCallDelta
from gateway.request import ChatRequest
from gateway.responses.request import ResponsesBody, parse
from gateway.responses.response import (
    CALL_KINDS,
    ResponseShell,
    call_item,
    finish_call,
    finish_reasoning,
    reasoning_item,
    reasoning_part,
    summary_part,
    text_part,
    usage_of,
)

__all__ = [
    "ResponsesBody",
    "ResponsesStreamEncoder",
    "error_body",
    "parse",
    "response_body",
    "usage_of",
]


def error_body(error: Error) -> dict[str, Any]:
    """OpenAI's error body, ``param`` named as a Responses request names it: an upstream's
    context overflow names Chat's ``messages``, which here is ``input``."""
    body = openai_error_body(error)
    if body["error"]["param"] == "messages":
        body["error"]["param"] = "input"
    return body


# -- the stream ------------------------------------------------------------------------------------

_Payload = dict[str, Any]


class ResponsesStreamEncoder:
    """Internal events → Responses stream events, one open output item at a time.

    ``start_events()`` and ``events(event)`` give the events as numbered dicts, for any
    transport; ``start()`` and ``encode(event)`` frame them as SSE (the exchange's ``Encoder``).
    After the terminal event ``final`` is the finished response object. ``response_id`` names
    the response (default: a fresh ``resp_`` id).
    """

    def __init__(
        self, request: ChatRequest, body: ResponsesBody, response_id: str | None = None
    ) -> None:
        self.shell = ResponseShell(request, body, response_id)
        self.acc = Accumulator()
        self.final: _Payload | None = None
        self._seq = 0
        self._output: list[_Payload] = []  # finished items
        self._item: _Payload | None = None  # the open item
        self._kind = ""  # its kind: message, reasoning, summary, function_call, custom_tool_call
        self._parts: list[str] = []  # the open message/reasoning/summary item's text so far
        self._index = -1  # its output_index
        self._tool_index: int | None = None  # the tool call the open call item is
        self._served = body._tools.served
        self._encrypted = body.encrypted_reasoning
        self._opened: ToolCallState | None = None  # the call the event being encoded opened
        self._handlers: dict[type, Callable[[Any], list[_Payload]]] = {
            TextDelta: self._text,
            ReasoningDelta: self._reasoning,
            Progress: self._progress,
            ToolCallDelta: self._tool_call,
            Done: self._done,
            Error: self._error,
        }
        self._closers: dict[str, Callable[[_Payload, str, str], tuple[list[_Payload], _Payload]]]
        self._closers = {
            "message": self._close_message,
            "reasoning": self._close_reasoning,
            "summary": self._close_summary,
            "function_call": self._close_call,
            "custom_tool_call": self._close_custom,
        }

    # -- the Encoder protocol: SSE frames ---------------------------------------------------------

    def start(self) -> bytes:
        return _frames(self.start_events())

    def encode(self, event: Event) -> bytes:
        return _frames(self.events(event))

    def keepalive(self) -> bytes:
        """A ``response.in_progress`` event with the response as it stands: no content, but an
        event. Codex CLI's idle timeout (300 s) counts only events, never SSE comments, so a
        comment could not keep its turn alive through a long prefill."""
        return _frames([self.status_event("in_progress")])

    # -- events as dicts --------------------------------------------------------------------------

    def start_events(self) -> list[_Payload]:
        return [self.status_event("created", "in_progress"), self.status_event("in_progress")]

    def status_event(self, kind: str, status: str | None = None) -> _Payload:
        """``response.<kind>`` with the response as it stands (a background run starts
        ``created``/``queued`` with status ``queued``, then goes ``in_progress``)."""
        response = self.shell.response(status or kind, list(self._output))
        return self._event(f"response.{kind}", response=response)

    @property
    def output(self) -> list[_Payload]:
        """The finished output items so far."""
        return list(self._output)

    def output_so_far(self) -> list[_Payload]:
        """The finished items and the open one as it stands (``in_progress``, its text so far):
        what a poll of a running background response shows, as OpenAI's does."""
        item = self._item
        if item is None:
            return self.output
        text = "".join(self._parts)
        if self._kind == "message":
            partial = dict(item, content=[text_part(text)])
        elif self._kind == "reasoning":
            partial = dict(item, content=[reasoning_part(text)])
        elif self._kind == "summary":
            partial = dict(item, summary=[summary_part(text)])
        else:  # a tool call: its arguments so far (a custom tool's input only once complete)
            partial = dict(item)
        return [*self._output, partial]

    def events(self, event: Event) -> list[_Payload]:
        """The stream events for one internal event (none for ``Usage``, ``Sampling``, ``Meta``:
        they only reach the final response)."""
        self._opened = self.acc.add(event)
        handler = self._handlers.get(type(event))
        return handler(event) if handler is not None else []

    def _event(self, kind: str, **payload: Any) -> _Payload:
        out = {"type": kind, "sequence_number": self._seq, **payload}
        self._seq += 1
        return out

    def _where(self) -> _Payload:
        assert self._item is not None
        return {"item_id": self._item["id"], "output_index": self._index, "content_index": 0}

    def _summary_where(self) -> _Payload:
        """Where the open summary item's one summary part is (progress notes all append to it)."""
        assert self._item is not None
        return {"item_id": self._item["id"], "output_index": self._index, "summary_index": 0}

    def _open(self, kind: str, item: _Payload) -> list[_Payload]:
        out = self._close()
        self._item, self._kind, self._parts, self._index = item, kind, [], len(self._output)
        # A copy: the open item changes as deltas come (a function call's arguments), the event
        # must not (a transport may hold it before writing).
        added = self._event("response.output_item.added", output_index=self._index, item=dict(item))
        out.append(added)
        if kind == "summary":
            part = summary_part("")
            where = self._summary_where()
            out.append(self._event("response.reasoning_summary_part.added", **where, part=part))
        elif kind in ("message", "reasoning"):
            part = text_part("") if kind == "message" else reasoning_part("")
            out.append(self._event("response.content_part.added", **self._where(), part=part))
        return out

    def _ensure(self, kind: str, make: Callable[[], _Payload]) -> list[_Payload]:
        """Open an item of ``kind`` unless it is the open one."""
        if self._kind == kind and self._item is not None:
            return []
        return self._open(kind, make())

    def _close(self, status: str = "completed") -> list[_Payload]:
        item = self._item
        if item is None:
            return []
        out, done = self._closers[self._kind](item, "".join(self._parts), status)
        self._item = None
        out.append(self._event("response.output_item.done", output_index=self._index, item=done))
        self._output.append(done)
        return out

    def _close_message(self, item: _Payload, text: str, status: str) -> tuple[list, _Payload]:
        where, part = self._where(), text_part(text)
        out = [
            self._event("response.output_text.done", **where, text=text, logprobs=[]),
            self._event("response.content_part.done", **where, part=part),
        ]
        return out, dict(item, status=status, content=[part])

    def _close_reasoning(self, item: _Payload, text: str, status: str) -> tuple[list, _Payload]:
        where, part = self._where(), reasoning_part(text)
        out = [
            self._event("response.reasoning.done", **where, text=text),
            self._event("response.content_part.done", **where, part=part),
        ]
        # the spec's reasoning item has no status
        return out, finish_reasoning(item, text, self._encrypted)

    def _close_summary(self, item: _Payload, text: str, status: str) -> tuple[list, _Payload]:
        where, part = self._summary_where(), summary_part(text)
        out = [
            self._event("response.reasoning_summary_text.done", **where, text=text),
            self._event("response.reasoning_summary_part.done", **where, part=part),
        ]
        return out, dict(item, summary=[part])

    def _close_call(self, item: _Payload, text: str, status: str) -> tuple[list, _Payload]:
        where = {"item_id": item["id"], "output_index": self._index}
        done = self._event(
            "response.function_call_arguments.done", **where, arguments=item["arguments"]
        )
        return [done], dict(item, status=status)

    def _close_custom(self, item: _Payload, text: str, status: str) -> tuple[list, _Payload]:
        # OpenAI streams the input as custom_tool_call_input deltas; the spec has no such
        # events, and the input is only plain text once the JSON around it is complete.
        return [], finish_call(item, text, status)

    def _text(self, event: TextDelta) -> list[_Payload]:
        out = self._ensure(
            "message",
            lambda: {
                "type": "message",
                "id": new_id("msg_"),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            },
        )
        self._parts.append(event.text)
        delta = self._event(
            "response.output_text.delta", **self._where(), delta=event.text, logprobs=[]
        )
        return [*out, delta]

    def _reasoning(self, event: ReasoningDelta) -> list[_Payload]:
        out = self._ensure(
            "reasoning",
            lambda: {"type": "reasoning", "id": new_id("rs_"), "summary": [], "content": []},
        )
        self._parts.append(event.text)
        return [*out, self._event("response.reasoning.delta", **self._where(), delta=event.text)]

    def _progress(self, event: Progress) -> list[_Payload]:
        """A progress note: appended to the open summary item, else opening one."""
        out = self._ensure(
            "summary", lambda: {"type": "reasoning", "id": new_id("rs_"), "summary": []}
        )
        self._parts.append(event.text)
        delta = self._event(
            "response.reasoning_summary_text.delta", **self._summary_where(), delta=event.text
        )
        return [*out, delta]

    def _tool_call(self, event: ToolCallDelta) -> list[_Payload]:
        out: list[_Payload] = []
        opened = self._opened
        if (
            opened is not None
            or self._item is None
            or self._kind not in CALL_KINDS
            or self._tool_index != event.index
        ):
            call = opened or self.acc.tool_calls[event.index]
            self._tool_index = event.index
            opening = call_item(call, self._served)
            out = self._open(opening["type"], opening)
        item = self._item
        if not event.arguments or item is None:
            return out
        if self._kind == "custom_tool_call":  # plain text only at the end (_close_custom)
            self._parts.append(event.arguments)
            return out
        item["arguments"] += event.arguments
        where = {"item_id": item["id"], "output_index": self._index}
        return [
            *out,
            self._event("response.function_call_arguments.delta", **where, delta=event.arguments),
        ]

    def _done(self, event: Done) -> list[_Payload]:
        status = "incomplete" if self.acc.finish_reason == "length" else "completed"
        out = self._close(status)
        self.final = self.shell.response(status, list(self._output), self.acc)
        return [*out, self._event(f"response.{status}", response=self.final)]

    def _error(self, event: Error) -> list[_Payload]:
        out = self._close("incomplete")
        # The spec's ErrorStreamingEvent: the payload (type, code, message, param) nested, as in
        # the non-streaming error body; then the failed response with the spec's Error.
        out.append(self._event("error", error=error_body(event)["error"]))
        self.final = self.shell.response("failed", list(self._output), self.acc)
        return [*out, self._event("response.failed", response=self.final)]


def _frames(events: list[_Payload]) -> bytes:
    return b"".join(sse.named_frame(event["type"], event) for event in events)


def response_body(
    request: ChatRequest, body: ResponsesBody, acc: Accumulator, response_id: str | None = None
) -> dict[str, Any]:
    """The whole response object for a non-streaming call."""
    output: list[_Payload] = []
    status = "incomplete" if acc.finish_reason == "length" else "completed"
    if acc.progress:
        output.append(
            {"type": "reasoning", "id": new_id("rs_"), "summary": [summary_part(acc.progress)]}
        )
    if acc.reasoning:
        output.append(reasoning_item(acc.reasoning, body.encrypted_reasoning))
    if acc.text or not acc.tool_calls:
        output.append(
            {
                "type": "message",
                "id": new_id("msg_"),
                "status": status,
                "role": "assistant",
                "content": [text_part(acc.text)],
            }
        )
    for call in acc.tool_calls.values():
        output.append(finish_call(call_item(call, body._tools.served), call.arguments, status))
    return ResponseShell(request, body, response_id).response(status, output, acc)
