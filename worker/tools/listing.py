"""Tool listings that fit the model's context: full, brief, or names only.

Agent harnesses send every tool they have with a manual for each: Claude Code's 25 tools are
~20,000 SmolLM2 tokens, more than twice that model's whole context, while its system prompt and
first turn are ~3,000. Refusing such a request helps nobody (the client cannot compact a first
turn), so the worker lists the tools in the most detailed form that leaves the conversation a
share of the context (:data:`RESERVE_SHARE`):

- ``full``: the tools as sent;
- ``brief``: each description cut to its first sentence, the schemas without their
  ``description``/``examples``/``title``/``default`` annotations (every name and type stays);
- ``names``: the first sentence and the top-level parameters' names and types only.

The choice depends on the conversation and the model alone (not on ``max_tokens``), so a
session's turns keep one listing, and its prompt prefix, until the conversation itself grows
past the reserve. Calls are parsed the same way whatever the listing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Literal, TypeVar

Listing = Literal["full", "brief", "names"]
LISTINGS: tuple[Listing, ...] = ("full", "brief", "names")

# The share of the context a listing must leave free for the rest of the conversation and the
# answer; at most MAX_RESERVE tokens on a long-context model.
RESERVE_SHARE = 0.25
MAX_RESERVE = 8192

_ANNOTATIONS = frozenset({"description", "examples", "title", "default", "$schema", "$comment"})
# Keywords whose keys are property names (a parameter may be called "description"), and those
# whose values are data, not schemas.
_NAMED = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_DATA = frozenset({"enum", "const"})
_FIRST_SENTENCE = re.compile(r"(.+?[.!?])(?=\s|$)", re.S)
_MAX_BRIEF = 200  # characters of a brief description: a first "sentence" may be a whole manual

T = TypeVar("T")


def reserve(context: int) -> int:
    return min(int(context * RESERVE_SHARE), MAX_RESERVE)


def fit(
    render: Callable[[Listing], T], size: Callable[[T], int], context: int
) -> tuple[T, Listing]:
    """The most detailed listing whose prompt leaves :func:`reserve` tokens of ``context``,
    else the smallest one (which may still be too long: the caller refuses that)."""
    budget = context - reserve(context)
    for listing in LISTINGS:
        prompt = render(listing)
        if size(prompt) <= budget or listing == LISTINGS[-1]:
            return prompt, listing
    raise AssertionError("unreachable")


def listed(tools: list[dict[str, Any]], listing: Listing) -> list[dict[str, Any]]:
    """``tools`` (OpenAI function tools) as ``listing`` shows them."""
    if listing == "full":
        return tools
    return [_shortened(tool, listing) for tool in tools]


def _shortened(tool: dict[str, Any], listing: Listing) -> dict[str, Any]:
    function = tool.get("function", tool)
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    short = {
        "name": function.get("name"),
        "description": first_sentence(function.get("description") or ""),
        "parameters": _unannotated(parameters) if listing == "brief" else top_level(parameters),
    }
    return {"type": "function", "function": short} if "function" in tool else short


def first_sentence(text: str) -> str:
    paragraph = text.strip().split("\n\n", 1)[0].strip()
    match = _FIRST_SENTENCE.match(paragraph)
    sentence = " ".join((match.group(1) if match else paragraph).split())
    return sentence if len(sentence) <= _MAX_BRIEF else sentence[: _MAX_BRIEF - 1] + "…"


def _unannotated(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_unannotated(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _NAMED and isinstance(value, dict):  # keys here are names, not keywords
            out[key] = {name: _unannotated(sub) for name, sub in value.items()}
        elif key in _DATA:
            out[key] = value
        elif key not in _ANNOTATIONS:
            out[key] = _unannotated(value)
    return out


def top_level(schema: Any) -> dict[str, Any]:
    """An object schema cut to its properties' types and what is required."""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(properties, dict):
        return {"type": "object", "properties": {}}
    kept = {name: {"type": type_name(spec)} for name, spec in properties.items()}
    out: dict[str, Any] = {"type": "object", "properties": kept}
    if isinstance(required := schema.get("required"), list):
        out["required"] = [name for name in required if name in kept]
    return out


def type_name(spec: Any) -> str:
    if not isinstance(spec, dict):
        return "any"
    kind = spec.get("type")
    if isinstance(kind, list):
        return "|".join(str(k) for k in kind)
    if isinstance(kind, str):
        return kind
    if "enum" in spec:
        return "enum"
    if any(k in spec for k in ("anyOf", "oneOf")):
        return "|".join(type_name(s) for s in spec.get("anyOf") or spec.get("oneOf") or ())
    return "any"
