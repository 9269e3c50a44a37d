"""One answer as it is built from stream events: text, reasoning, tool calls, usage, finish.

Every API's non-streaming body and the request log are made from an :class:`Accumulator`; ids
and tool-name clamping are shared by every API encoder.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from gateway.events import (
    ChoiceEvent,
    Done,
    Error,
    Event,
    Meta,
    Progress,
    ReasoningDelta,
    Sampling,
    TextDelta,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)

MAX_TOOL_NAME = 200


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def clamp_tool_name(name: str | None) -> str:
    """Models emit empty or runaway names; clients reject both, so clamp once where read."""
    if not name:
        return "unknown"
    return name[:MAX_TOOL_NAME]


@dataclass
class ToolCallState:
    id: str
    name: str
    arguments: str = ""


@dataclass
class Accumulator:
    """The whole answer so far: what non-streaming bodies and final events are built from."""

    # Parts, joined on demand: += on a long answer would copy it once per token (quadratic).
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the text's tokens, if asked for
    reasoning_parts: list[str] = field(default_factory=list)
    reasoning_deltas: int = 0
    # Progress notes ("asking 3 models…"): kept apart from reasoning, they are not the model's.
    progress_parts: list[str] = field(default_factory=list)
    tool_calls: dict[int, ToolCallState] = field(default_factory=dict)
    usage: Usage | None = None
    sampling: Sampling | None = None  # the values the upstream generated with, if it said
    finish_reason: str | None = None
    stop_sequence: str | None = None  # the stop string that ended a "stop" answer
    error: Error | None = None
    # A request for several answers (gateway/choices.py): each choice's own, by index; the
    # fields above then hold the request's whole usage and its end.
    choices: dict[int, Accumulator] = field(default_factory=dict)
    # Route facts (``Meta`` headers: ``x-moa-*`` …) the Responses API copies into ``metadata``.
    meta: dict[str, str] = field(default_factory=dict)

    def add(self, event: Event) -> ToolCallState | None:
        """Fold one event in; returns the tool call when ``event`` opened a new one."""
        if isinstance(event, ChoiceEvent):
            return self.choices.setdefault(event.index, Accumulator()).add(event.event)
        if isinstance(event, TextDelta):
            self.text_parts.append(event.text)
            if event.logprobs:
                self.logprobs.extend(event.logprobs)
        elif isinstance(event, ReasoningDelta):
            self.reasoning_parts.append(event.text)
            self.reasoning_deltas += 1
        elif isinstance(event, Progress):
            self.progress_parts.append(event.text)
        elif isinstance(event, ToolCallDelta):
            return self._add_tool_call(event)
        elif isinstance(event, Usage | Sampling | Meta):
            self._note(event)
        elif isinstance(event, Done):
            self.finish_reason = event.finish_reason
            # A tool call is a tool call even when the model (or parser) said "stop".
            if self.tool_calls and event.finish_reason == "stop":
                self.finish_reason = "tool_calls"
            if self.finish_reason == "stop":
                self.stop_sequence = event.stop_sequence
        elif isinstance(event, Error):
            self.error = event
        return None

    def _note(self, event: Usage | Sampling | Meta) -> None:
        """Facts about the answer rather than part of it."""
        if isinstance(event, Usage):
            self.usage = event
        elif isinstance(event, Sampling):
            self.sampling = event
        else:
            self.meta.update(event.headers)

    def _add_tool_call(self, event: ToolCallDelta) -> ToolCallState | None:
        call = self.tool_calls.get(event.index)
        if call is None:
            call = ToolCallState(id=event.id or new_id("call_"), name=clamp_tool_name(event.name))
            call.arguments = event.arguments
            self.tool_calls[event.index] = call
            return call
        call.arguments += event.arguments
        return None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)

    @property
    def progress(self) -> str:
        return "".join(self.progress_parts)

    @property
    def prompt_tokens(self) -> int:
        return self.usage.prompt_tokens if self.usage else 0

    @property
    def completion_tokens(self) -> int:
        return self.usage.completion_tokens if self.usage else 0

    @property
    def cached_tokens(self) -> int:
        return self.usage.cached_tokens if self.usage else 0
