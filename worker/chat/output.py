"""Model text → OpenAI deltas: think split first, then tool calls out of the content.

``DeltaAssembler`` is pure: fed the text of each engine chunk, it returns OpenAI ``delta`` dicts
(``reasoning_content``, ``content`` or ``tool_calls``); ``finish`` flushes what is held back.
The same object also accumulates a non-streaming message.
"""

from __future__ import annotations

from typing import Any

from worker.chat.thinking import ThinkSplitter
from worker.tools.parsing import ParsedToolCall, ToolCallSplitter


class DeltaAssembler:
    def __init__(
        self,
        *,
        think_tags: tuple[str, str] | None,
        in_reasoning: bool,
        tool_splitter: ToolCallSplitter | None,
    ) -> None:
        self._think = (
            ThinkSplitter(
                in_reasoning=in_reasoning, open_tag=think_tags[0], close_tag=think_tags[1]
            )
            if think_tags
            else None
        )
        self._tools = tool_splitter
        self.tool_calls: list[ParsedToolCall] = []
        self.content: list[str] = []
        self.reasoning: list[str] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        pieces = self._think.feed(text) if self._think else [("content", text)]
        return self._route(pieces)

    def finish(self) -> list[dict[str, Any]]:
        deltas = self._route(self._think.finish()) if self._think else []
        if self._tools is not None:
            deltas.extend(self._from_tool_pieces(self._tools.finish()))
        return deltas

    def _route(self, pieces: list[tuple[str, str]]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for kind, text in pieces:
            if kind == "reasoning":
                self.reasoning.append(text)
                deltas.append({"reasoning_content": text})
            elif self._tools is not None:
                deltas.extend(self._from_tool_pieces(self._tools.feed(text)))
            elif text:
                self.content.append(text)
                deltas.append({"content": text})
        return deltas

    def _from_tool_pieces(self, pieces: list[tuple[str, Any]]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for kind, value in pieces:
            if kind == "tool_call":
                index = len(self.tool_calls)
                self.tool_calls.append(value)
                deltas.append({"tool_calls": [tool_call_dict(value, index)]})
            elif kind == "tool_call_start":
                call_id, name = value
                index = len(self.tool_calls)
                self.tool_calls.append(ParsedToolCall(call_id, name, ""))
                deltas.append({"tool_calls": [tool_call_dict(self.tool_calls[index], index)]})
            elif kind == "tool_call_args":
                index = len(self.tool_calls) - 1
                fragment = {"index": index, "function": {"arguments": value}}
                deltas.append({"tool_calls": [fragment]})
            elif kind == "tool_call_end":
                self.tool_calls[-1] = value  # the whole call, for the non-streaming message
            elif value:
                self.content.append(value)
                deltas.append({"content": value})
        return deltas

    def message(self) -> dict[str, Any]:
        """The assistant message of a non-streaming response."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [tool_call_dict(c) for c in self.tool_calls]
        elif message["content"] is None:
            message["content"] = ""
        return message


def tool_call_dict(call: ParsedToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    if index is not None:
        out["index"] = index
    return out
