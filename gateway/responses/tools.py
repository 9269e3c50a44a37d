"""The ``tools`` of a Responses request: what the model is shown, and how its calls go back.

Every tool type OpenAI defines is accepted; what becomes of one depends on who runs it:

- ``function``: shown as it is.
- ``namespace``: its inner function/custom tools are shown flattened as ``<namespace>__<name>``
  (Codex's own flat form), and a call to one goes back as OpenAI sends it: the inner ``name``
  with the ``namespace`` beside it (a client routes by the pair).
- ``custom`` (freeform input, e.g. Codex's ``apply_patch``): shown as a function taking one
  string, ``input`` (the grammar, if any, put in its description: nothing here can hold a model
  to a grammar); a call to one goes back as OpenAI's ``custom_tool_call`` item, the ``input``
  as plain text.
- Hosted tools (web search, file search, code interpreter, MCP, …) and the ones only OpenAI's
  models emit their own items for (``local_shell``, ``shell``, ``apply_patch``, ``computer``,
  ``tool_search``): nothing here runs or emits them, so they are left out of the prompt and
  named in the ``x-tools-ignored`` header (:func:`ignored_header`) instead of refused.

A tool of no type OpenAI defines, or a function/custom tool without a name, is a 400 naming it.
The response object echoes the tools as the model saw them: the spec's ``FunctionTool`` objects.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, StringConstraints

from gateway.refusals import RequestInvalid, validated
from gateway.request import ToolSpec

log = logging.getLogger(__name__)

IGNORED_HEADER = "x-tools-ignored"

# OpenAI's tool types (openai-python ``ToolParam``) that nothing on a node runs or emits.
HOSTED_TYPES = frozenset(
    {
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "mcp",
        "computer",
        "computer_use_preview",
        "programmatic_tool_calling",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
    }
)

_Name = Annotated[str, StringConstraints(min_length=1)]
_INPUT = "input"  # the one argument a custom tool's function form takes


class _FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")  # defer_loading, output_schema, allowed_callers…

    type: Literal["function"]
    name: _Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Format(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "grammar"]
    syntax: str | None = None  # "lark" or "regex" for a grammar
    definition: str | None = None


class _CustomTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["custom"]
    name: _Name
    description: str | None = None
    format: _Format | None = None


class _NamespaceTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["namespace"]
    name: _Name
    description: str | None = None
    tools: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class ServedTool:
    """How the client knows a tool the model calls by its flat name."""

    name: str
    namespace: str | None = None
    custom: bool = False


@dataclass
class Tools:
    """The request's tools, sorted: ``specs`` go to the model, ``served`` maps the names it
    calls them by back to the client's, ``ignored`` are the hosted types left out."""

    specs: list[ToolSpec] = field(default_factory=list)
    # The response object's ``tools``: the spec's FunctionTool for each tool shown.
    echo: list[dict[str, Any]] = field(default_factory=list)
    served: dict[str, ServedTool] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)


def flat_name(namespace: str | None, name: str) -> str:
    """The name a model sees a namespaced tool by (Codex's flat form: ``ns__name``)."""
    if not namespace:
        return name
    return f"{namespace.rstrip('_')}__{name.lstrip('_')}"


def custom_arguments(text: str) -> str:
    """A custom tool call's plain-text input as the function arguments the model gave."""
    return orjson.dumps({_INPUT: text}).decode()


def custom_input(arguments: str) -> str:
    """The plain-text input of a custom tool call from the model's function arguments; a model
    that wrote the text itself, not JSON, is taken at its word."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(_INPUT), str):
        return value[_INPUT]
    return value if isinstance(value, str) else arguments


def parse_tools(raw: list[Any] | None) -> Tools:
    tools = Tools()
    for i, tool in enumerate(raw or []):
        _add(tools, tool, f"tools.{i}", namespace=None)
    if tools.ignored:
        log.info("responses: hosted tools left out (not run here): %s", ",".join(tools.ignored))
    return tools


def ignored_header(tools: Tools) -> dict[str, str]:
    return {IGNORED_HEADER: ",".join(tools.ignored)} if tools.ignored else {}


def _add(tools: Tools, tool: Any, where: str, namespace: str | None) -> None:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind == "function":
        function = validated(_FunctionTool, tool, where)
        _show(tools, function.name, namespace, function.description, function.parameters)
        tools.echo[-1]["strict"] = function.strict
    elif kind == "custom":
        custom = validated(_CustomTool, tool, where)
        parameters = {
            "type": "object",
            "properties": {_INPUT: {"type": "string", "description": "Plain text, not JSON."}},
            "required": [_INPUT],
        }
        _show(tools, custom.name, namespace, _custom_description(custom), parameters, custom=True)
    elif kind == "namespace" and namespace is None:
        group = validated(_NamespaceTool, tool, where)
        for j, inner in enumerate(group.tools):
            if not isinstance(inner, dict) or inner.get("type") not in ("function", "custom"):
                raise RequestInvalid(
                    f"{where}.tools.{j}.type: a namespace holds function and custom tools only",
                    f"{where}.tools.{j}.type",
                )
            _add(tools, inner, f"{where}.tools.{j}", group.name)
    elif isinstance(kind, str) and kind in HOSTED_TYPES and namespace is None:
        if kind not in tools.ignored:
            tools.ignored.append(kind)
    else:
        raise RequestInvalid(f"{where}.type: tool type {kind!r} is not supported", f"{where}.type")


def _show(
    tools: Tools,
    name: str,
    namespace: str | None,
    description: str | None,
    parameters: dict[str, Any] | None,
    custom: bool = False,
) -> None:
    shown = flat_name(namespace, name)
    schema = parameters or {"type": "object", "properties": {}}
    tools.specs.append(ToolSpec(name=shown, description=description or "", parameters=schema))
    tools.echo.append(
        {
            "type": "function",
            "name": shown,
            "description": description,
            "parameters": parameters,
            "strict": None,
        }
    )
    if namespace is not None or custom:
        tools.served[shown] = ServedTool(name=name, namespace=namespace, custom=custom)


def _custom_description(tool: _CustomTool) -> str:
    text = tool.description or ""
    fmt = tool.format
    if fmt is not None and fmt.type == "grammar" and fmt.definition:
        syntax = fmt.syntax or "grammar"
        return f"{text}\n\n`input` follows this {syntax} grammar:\n{fmt.definition}".lstrip()
    return text
