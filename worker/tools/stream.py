"""A tool call's arguments, streamed while the model writes them.

For spans shaped ``{"name": "…", "arguments": {…}}`` (the JSON form most chat templates ask for)
the call starts as soon as its name and the arguments' opening brace are out, and the arguments'
JSON text follows piece by piece. Other span shapes are not recognised here and stay whole.
Pure: fed the span text so far, returns what became safe to send.
"""

from __future__ import annotations

import json
import re

# The span up to the arguments object's opening brace: name first, arguments an object.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')


class ArgumentStreamer:
    """Follows one span; ``feed(span_so_far, safe_end)`` returns new arguments text.

    ``name`` is set once the head of the call is recognised (then the call has started); the
    arguments text runs from its ``{`` to the matching ``}``, found by tracking JSON strings and
    nesting, so nothing after the object (the outer ``}``, an end tag) is ever sent.
    """

    def __init__(self) -> None:
        self.name: str | None = None
        self.arguments: list[str] = []
        self.closed = False  # the arguments object is complete
        self._at = 0  # span offset up to which the arguments were read
        self._depth = 0
        self._in_string = False
        self._escaped = False

    @property
    def started(self) -> bool:
        return self.name is not None

    def feed(self, span: str, safe_end: int | None = None) -> str:
        """Arguments text that arrived in ``span[:safe_end]`` since the previous call."""
        end = len(span) if safe_end is None else safe_end
        if self.name is None:
            head = _HEAD.match(span, 0, end)
            if head is None:
                return ""
            try:
                name = json.loads(head.group(1))
            except ValueError:
                return ""
            if not isinstance(name, str):
                return ""
            self.name = name
            self._at = head.end()
        if self.closed or end <= self._at:
            return ""
        start = self._at
        stop = self._scan(span, start, end)
        self._at = stop
        piece = span[start:stop]
        if piece:
            self.arguments.append(piece)
        return piece

    def _scan(self, span: str, start: int, end: int) -> int:
        for i in range(start, end):
            char = span[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.closed = True
                    return i + 1
        return end

    def text(self) -> str:
        return "".join(self.arguments)
