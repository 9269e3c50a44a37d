"""Forced tool calls: ``tool_choice`` "required" or a named function as a grammar for the call text.

A small model asked for a call often answers in prose instead. When the client says it must
call (any tool, or one it names), the answer is held by constrained decoding to exactly the text
the tool parser reads back as one call – the model's own syntax when its template has one
(:func:`call_syntax`, the same markers the splitter cuts on), else the generic prompt's::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``name`` is one of the allowed tools and ``arguments`` follows that tool's parameter schema
(written like structured output's JSON, :data:`GRAMMAR_OPTIONS`), so the answer always parses
into a call to an allowed tool with valid arguments. Syntaxes that are not JSON (Pythonic,
XML-style parameters…) have no grammar here: there the choice is not enforced.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import llguidance

from worker.structured.json_grammar import (
    ANY_OBJECT,
    GRAMMAR_OPTIONS,
    SchemaError,
    is_panic,
    json_grammar,
    validator_tokenizer,
)
from worker.tools.parsing import DEFAULT_END, DEFAULT_START, SpanParser, parse_json_span

log = logging.getLogger(__name__)

# mlx-lm tool parser modules whose call is ``start {"name": …, "arguments": {…}} end``, and
# Mistral's ``[TOOL_CALLS]name[ARGS]{…}`` (no end marker). Others cannot be held to a grammar.
_JSON_PARSERS = frozenset({"json_tools"})
_MISTRAL_PARSERS = frozenset({"mistral"})
_LENIENT = {**GRAMMAR_OPTIONS, "lenient": True}
_DATA = frozenset({"enum", "const", "default", "examples"})  # values that are data, not schemas

SyntaxKind = Literal["json", "mistral", "other"]
# The special token id a marker is spelled with in the model's vocabulary, or None.
SpecialId = Callable[[str], int | None]


class ToolChoiceError(ValueError):
    """A ``tool_choice`` the request cannot have (the app answers 400 naming ``tool_choice``)."""


@dataclass(frozen=True, slots=True)
class CallSyntax:
    """How this model writes a tool call: what the splitter cuts on and the grammar spells."""

    kind: SyntaxKind
    start: str
    end: str
    parser: SpanParser


def call_syntax(tok: Any) -> CallSyntax:
    """The call syntax of mlx-lm's tokenizer wrapper ``tok`` (its tool parser when its template
    names one, else the generic prompt's JSON between ``<tool_call>`` tags)."""
    if not tok.has_tool_calling:
        return CallSyntax("json", DEFAULT_START, DEFAULT_END, parse_json_span)
    module = getattr(tok.tool_parser, "__module__", "").rsplit(".", 1)[-1]
    kind: SyntaxKind = (
        "json" if module in _JSON_PARSERS else "mistral" if module in _MISTRAL_PARSERS else "other"
    )
    return CallSyntax(kind, tok.tool_call_start, tok.tool_call_end or "", tok.tool_parser)


def forced_names(tool_choice: Any, tools: list[dict[str, Any]] | None) -> tuple[str, ...] | None:
    """The tools one of which the answer must call (in the request's order), None when the
    model may answer without a call ("auto", "none", absent). ToolChoiceError for a choice
    that is malformed, names no offered tool, or requires a call with no tools offered."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    offered = [name for tool in tools or () if (name := _name(tool))]
    if tool_choice == "required":
        if not offered:
            raise ToolChoiceError("tool_choice 'required' needs tools to call")
        return tuple(offered)
    name = _chosen_name(tool_choice)
    if name is None:
        raise ToolChoiceError(
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}'
        )
    if name not in offered:
        raise ToolChoiceError(f"tool_choice names function {name!r}, which is not in tools")
    return (name,)


def call_grammar(
    syntax: CallSyntax,
    tools: list[dict[str, Any]],
    names: tuple[str, ...],
    special: SpecialId = lambda _: None,
) -> str | None:
    """The llguidance grammar for exactly one call to one of ``names`` in ``syntax``; None
    when that syntax has no grammar here. ``special`` says which markers are special tokens
    (a grammar must spell those as the token, not as text)."""
    if syntax.kind == "other":
        return None
    by_name = {_name(tool): tool for tool in tools}
    held = [_parameters(by_name[name]) for name in names]
    options = GRAMMAR_OPTIONS if all(strict for _, strict in held) else _LENIENT
    if syntax.kind == "json":
        # The whole call is one JSON value: llguidance masks out tokens that would cross into
        # a nested grammar, so a model writes ``"arguments": {`` with its usual tokens only
        # when name and arguments are one grammar. It sits on its own line between the
        # markers, as the generic prompt shows it.
        calls = [_call_schema(name, schema, len(names) > 1, i) for i, (name, (schema, _)) in enumerate(zip(names, held, strict=True))]  # fmt: skip
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        body = f"%json {_dumps({**call, 'x-guidance': options})}"
        end = f' "\\n" {_literal(syntax.end, special)}'
        lark = f'start: {_literal(syntax.start, special)} "\\n" {body}{end}'
    else:  # mistral: name[ARGS]{…}, the call running to the end of the answer
        rules = [
            f"call_{i}: {_text(name + '[ARGS]')} %json {_dumps({**schema, 'x-guidance': options})}"
            for i, (name, (schema, _)) in enumerate(zip(names, held, strict=True))
        ]
        choice = " | ".join(f"call_{i}" for i in range(len(names)))
        lark = "\n".join([f"start: {_literal(syntax.start, special)} ({choice})", *rules])
    return llguidance.LLMatcher.grammar_from_lark(f"%llguidance {{}}\n{lark}")


def _call_schema(name: str, parameters: dict[str, Any], alternative: bool, i: int) -> Any:
    """``{"name": name, "arguments": parameters}`` as a schema; the references inside
    ``parameters`` (``#/$defs/…``, ``#``) repointed to where they now sit."""
    where = f"/anyOf/{i}/properties/arguments" if alternative else "/properties/arguments"
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": _repointed(parameters, where)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _repointed(node: Any, where: str) -> Any:
    if isinstance(node, list):
        return [_repointed(item, where) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = "#" + where + value[1:]
        elif key in _DATA:
            out[key] = value
        else:
            out[key] = _repointed(value, where)
    return out


def _parameters(tool: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The tool's parameter schema and whether llguidance holds it strictly; a schema it can
    hold only leniently (ignoring keywords it does not implement) is held so, one it cannot
    hold at all becomes any JSON object: a client's schema must not keep the call from being
    made."""
    function = tool.get("function", tool)
    schema = function.get("parameters") or ANY_OBJECT
    if not isinstance(schema, dict):
        return ANY_OBJECT, True
    schema = {k: v for k, v in schema.items() if k not in ("x-guidance", "$schema", "$id")}
    try:
        json_grammar(schema)
        return schema, True
    except SchemaError as exc:
        log.info("tool %r: parameters held leniently: %s", function.get("name"), exc.message)
    if _compiles({**schema, "x-guidance": _LENIENT}):
        return schema, False
    return ANY_OBJECT, True


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _compiles(schema: dict[str, Any]) -> bool:
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        is_error, _ = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, validator_tokenizer()
        )
    except ValueError:
        return False
    except BaseException as exc:
        if not is_panic(exc):
            raise
        return False
    return not is_error


def _literal(text: str, special: SpecialId) -> str:
    if not text:
        return ""
    token = special(text)
    return f"<[{token}]>" if token is not None else _text(text)


def _text(text: str) -> str:
    """A lark string literal (JSON's escapes are lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _name(tool: dict[str, Any]) -> str | None:
    function = tool.get("function", tool)
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) and name else None


def _chosen_name(tool_choice: Any) -> str | None:
    """The name in Chat's ``{"type": "function", "function": {"name": …}}`` (or Responses'
    flat ``{"type": "function", "name": …}``)."""
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        return None
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else tool_choice.get("name")
    return name if isinstance(name, str) and name else None
