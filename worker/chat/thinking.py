"""Thinking: one on/off/None setting from every knob clients use, and the ``<think>`` splitter.

``normalize_thinking(body)`` is THE one parser of thinking knobs: every public edge (the gateway's
three APIs, the worker's own API) calls it on the raw body, and everything downstream reads the
result (``ChatRequest.reasoning``). It knows the OpenAI, OpenRouter, vLLM, Qwen and Anthropic
spellings and returns True (on), False (off) or None (not asked, or "auto": the model's default).
Precedence, strongest first: ``chat_template_kwargs``; explicit booleans (``enable_thinking`` and
aliases); Anthropic ``thinking``; ``reasoning`` object; ``reasoning_effort``; budgets
(``thinking_budget`` and aliases). The same readers apply inside ``chat_template_kwargs``.

``ThinkSplitter`` turns streamed model text into reasoning and content pieces. It is pure and
chunking-invariant: any split of the same text into chunks gives the same reasoning and content.
"""

from __future__ import annotations

from typing import Any, Literal

THINKING_ALIASES = (
    "enable_thinking",
    "enableThinking",
    "enable_reasoning",
    "use_reasoning",
    "reasoning_enabled",
    "use_thinking",
    "thinking_enabled",
    "enable_think",
    "think_enabled",
)

# Keys templates read to switch thinking on or off: the aliases plus the bare names.
THINKING_SWITCHES = (*THINKING_ALIASES, "thinking", "reasoning")
# Token budgets for the thinking pass: a positive budget asks for thinking, 0 turns it off.
THINKING_BUDGETS = ("thinking_budget", "reasoning_budget", "max_thinking_tokens")

_TRUE = {"true", "on", "yes", "1", "enabled", "enable"}
_FALSE = {"false", "off", "no", "0", "disabled", "disable", "none"}


def _as_bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value != 0
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
    return None


def _from_effort(value: Any) -> bool | None:
    if not isinstance(value, str) or not value.strip():
        return None
    return value.strip().lower() != "none"


def _from_budget(value: Any) -> bool | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value != 0  # negative budgets mean "unlimited" in some APIs


def _from_budgets(source: dict[str, Any]) -> bool | None:
    for key in THINKING_BUDGETS:
        if (found := _from_budget(source.get(key))) is not None:
            return found
    return None


def _from_aliases(source: dict[str, Any]) -> bool | None:
    for key in THINKING_ALIASES:
        if key in source:
            found = _as_bool(source[key])
            if found is not None:
                return found
    return None


def _from_anthropic(value: Any) -> bool | None:
    if isinstance(value, dict):
        kind = value.get("type")
        if kind == "disabled":
            return False
        if kind in ("enabled", "adaptive"):
            return True
        return None
    return _as_bool(value)


def _from_reasoning(value: Any) -> bool | None:
    if not isinstance(value, dict):
        return _as_bool(value)
    if "enabled" in value and (found := _as_bool(value["enabled"])) is not None:
        return found
    if (found := _from_effort(value.get("effort"))) is not None:
        return found
    return _from_budget(value.get("max_tokens"))


def _from_knobs(source: dict[str, Any]) -> bool | None:
    """The knobs of one level (the body, or its ``chat_template_kwargs``), strongest first."""
    readers = (
        lambda: _from_aliases(source),
        lambda: _from_anthropic(source.get("thinking")) if "thinking" in source else None,
        lambda: _from_reasoning(source.get("reasoning")) if "reasoning" in source else None,
        lambda: _from_effort(source.get("reasoning_effort")),
        lambda: _from_budgets(source),
    )
    for read in readers:
        found = read()
        if found is not None:
            return found
    return None


def normalize_thinking(body: dict[str, Any]) -> bool | None:
    """True/False when any recognised knob in ``body`` asks for thinking on/off, else None."""
    if not isinstance(body, dict):
        return None
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and (found := _from_knobs(kwargs)) is not None:
        return found
    return _from_knobs(body)


Kind = Literal["reasoning", "content"]


class ThinkSplitter:
    """Splits streamed text at ``<think>``/``</think>`` into reasoning and content pieces.

    ``in_reasoning=True`` when the prompt already opened the block (generation starts inside it).
    Tags split across chunks are held back until they are decided; ``finish`` releases whatever is
    held (output cut off inside the block stays reasoning). Whitespace right after a tag is
    dropped, so ``</think>\\n\\nAnswer`` gives content ``Answer``.
    """

    def __init__(
        self, *, in_reasoning: bool = False, open_tag: str = "<think>", close_tag: str = "</think>"
    ) -> None:
        self._open = open_tag
        self._close = close_tag
        self._state: Kind = "reasoning" if in_reasoning else "content"
        self._held = ""
        self._strip = in_reasoning

    @property
    def state(self) -> Kind:
        return self._state

    def feed(self, text: str) -> list[tuple[Kind, str]]:
        out: list[tuple[Kind, str]] = []
        buffer = self._held + text
        while buffer:
            tag = self._close if self._state == "reasoning" else self._open
            at = buffer.find(tag)
            if at >= 0:
                self._emit(out, buffer[:at])
                buffer = buffer[at + len(tag) :]
                self._state = "content" if self._state == "reasoning" else "reasoning"
                self._strip = True
                continue
            keep = _partial_suffix(buffer, tag)
            self._emit(out, buffer[: len(buffer) - keep])
            buffer = buffer[len(buffer) - keep :]
            break
        self._held = buffer
        return out

    def finish(self) -> list[tuple[Kind, str]]:
        out: list[tuple[Kind, str]] = []
        held, self._held = self._held, ""
        self._emit(out, held)
        return out

    def _emit(self, out: list[tuple[Kind, str]], text: str) -> None:
        if self._strip:
            text = text.lstrip()
            if not text:
                return
            self._strip = False
        if not text:
            return
        if out and out[-1][0] == self._state:
            out[-1] = (self._state, out[-1][1] + text)
        else:
            out.append((self._state, text))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
