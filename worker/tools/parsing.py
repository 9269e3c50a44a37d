"""Tool calls in model output: cut ``<tool_call>…</tool_call>`` spans out of the content stream.

The tags and the span parser come from mlx-lm's tool parsers when the tokenizer names one (Qwen,
Mistral, Gemma, …); otherwise the span is JSON ``{"name": …, "arguments": …}``. A span that does
not parse is given back as plain content, so nothing the model wrote is lost – unless the call
already started streaming (``{"name": …, "arguments": {…`` spans, see ``tool_stream``): then the
call stands with the arguments the client already has.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from worker.tools.stream import ArgumentStreamer

MAX_TOOL_NAME = 200
DEFAULT_START = "<tool_call>"
DEFAULT_END = "</tool_call>"

SpanParser = Callable[[str, Any], Any]


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # JSON text


def clamp_tool_name(name: Any) -> str:
    """Empty or non-string names become "unknown"; names over 200 characters are truncated."""
    if not isinstance(name, str) or not name.strip():
        return "unknown"
    return name[:MAX_TOOL_NAME]


def parse_json_span(text: str, tools: Any = None) -> Any:
    return json.loads(text.strip())


def _to_calls(parsed: Any) -> list[ParsedToolCall]:
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        if not isinstance(item, dict):
            raise ValueError("tool call is not an object")
        if "function" in item and isinstance(item["function"], dict):
            item = item["function"]
        arguments = item.get("arguments", item.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(
            ParsedToolCall(
                id=new_call_id(),
                name=clamp_tool_name(item.get("name")),
                arguments=arguments,
            )
        )
    return calls


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallSplitter:
    """Streams content text through; returns ("content", str) and tool call pieces.

    A call comes whole as ("tool_call", call), or, when its arguments stream, as
    ("tool_call_start", (id, name)), ("tool_call_args", text)…, ("tool_call_end", call).
    """

    def __init__(
        self,
        *,
        start: str = DEFAULT_START,
        end: str | None = DEFAULT_END,
        parser: SpanParser = parse_json_span,
        tools: Any = None,
    ) -> None:
        self._start = start
        self._end = end or ""
        self._parser = parser
        self._tools = tools
        self._in_call = False
        self._held = ""
        self._streamer = ArgumentStreamer()
        self._call_id = ""

    def feed(self, text: str) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        buffer = self._held + text
        while buffer:
            if self._in_call:
                # ``buffer`` is the whole span so far: the streamer keeps its place in it.
                if not self._end:
                    out.extend(self._stream(buffer, len(buffer)))
                    break  # the call runs to the end of the output
                at = buffer.find(self._end)
                if at < 0:
                    safe = len(buffer) - _partial_suffix(buffer, self._end)
                    out.extend(self._stream(buffer, safe))
                    break
                out.extend(self._stream(buffer[:at], at))
                out.extend(self._close_span(buffer[:at]))
                buffer = buffer[at + len(self._end) :].lstrip()
                self._in_call = False
                continue
            at = buffer.find(self._start)
            if at >= 0:
                if buffer[:at]:
                    out.append(("content", buffer[:at]))
                buffer = buffer[at + len(self._start) :]
                self._in_call = True
                continue
            keep = _partial_suffix(buffer, self._start)
            if len(buffer) > keep:
                out.append(("content", buffer[: len(buffer) - keep]))
            buffer = buffer[len(buffer) - keep :]
            break
        self._held = buffer
        return out

    def finish(self) -> list[tuple[str, Any]]:
        held, self._held = self._held, ""
        if self._in_call:
            self._in_call = False
            out = self._stream(held, len(held))
            return out + self._close_span(held, complete=bool(not self._end))
        return [("content", held)] if held else []

    def _stream(self, span: str, safe_end: int) -> list[tuple[str, Any]]:
        streamer = self._streamer
        was_started = streamer.started
        piece = streamer.feed(span, safe_end)
        out: list[tuple[str, Any]] = []
        if streamer.started and not was_started:
            self._call_id = new_call_id()
            out.append(("tool_call_start", (self._call_id, clamp_tool_name(streamer.name))))
        if piece:
            out.append(("tool_call_args", piece))
        return out

    def _close_span(self, span: str, complete: bool = True) -> list[tuple[str, Any]]:
        streamer, self._streamer = self._streamer, ArgumentStreamer()
        if not streamer.started:
            return self._parse(span, complete)
        name = clamp_tool_name(streamer.name)
        return [("tool_call_end", ParsedToolCall(self._call_id, name, streamer.text()))]

    def _parse(self, span: str, complete: bool = True) -> list[tuple[str, Any]]:
        try:
            return [("tool_call", call) for call in _to_calls(self._parser(span, self._tools))]
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            # Not a call after all (or cut off): keep the model's text as content.
            tail = self._end if complete and self._end else ""
            return [("content", self._start + span + tail)]


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
