"""Tool calling for chat templates that cannot render tools: a documented generic tool prompt.

Some models' templates (SmolLM2's, many base-model templates) drop ``tools`` and assistant tool
calls without a word, so the model never learns it has tools. :func:`renders_tools` finds out by
rendering a probe; where it fails, :func:`generic_messages` puts the tools into the system
message and writes past calls and results as text, in the Hermes/Qwen convention the tool parser
already reads by default (:mod:`worker.tools.parsing`)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and results come back as a user turn holding ``<tool_response>…</tool_response>``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from worker.tools.listing import Listing, first_sentence, listed, top_level
from worker.tools.parsing import DEFAULT_END, DEFAULT_START

_PROBE_TOOL = "zz_probe_tool_7f3a"
_PROBE_CALL = "zz_probe_call_7f3a"

GENERIC_TOOL_PROMPT = """# Tools

You can call the tools listed below. To call one, answer with only this block (one block per \
call, several blocks for several calls):
{start}
{{"name": "<tool name>", "arguments": {{<the arguments, as JSON>}}}}
{end}
Each result comes back to you inside <tool_response></tool_response>; then go on with the task. \
Call a tool only when you need it; otherwise answer normally.

Available tools ({form}):
{tools}"""

Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]


def renders_tools(render: Render) -> bool:
    """Whether the template shows the model both the tools and a past tool call."""
    tool = {
        "type": "function",
        "function": {"name": _PROBE_TOOL, "description": "probe", "parameters": {"type": "object"}},
    }
    call = {"id": "call_probe", "type": "function", "function": {"name": _PROBE_CALL, "arguments": "{}"}}  # fmt: skip
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_probe", "content": "ok"},
    ]
    try:
        text = render(messages, [tool])
    except Exception:  # a template that raises on tools cannot render them either
        return False
    return _PROBE_TOOL in text and _PROBE_CALL in text


def tools_section(tools: list[dict[str, Any]], listing: Listing = "full") -> str:
    """The system message's tools part, the tools shown as ``listing`` has them
    (:mod:`worker.tools.listing`): JSON Schema, or one signature line each."""
    if listing == "names":
        lines, form = [_signature(tool) for tool in tools], "name(parameter: type, optional?: type)"
    else:
        lines = [json.dumps(_spec(tool), ensure_ascii=False) for tool in listed(tools, listing)]
        form = "JSON Schema"
    listed_tools = "\n".join(lines)
    return GENERIC_TOOL_PROMPT.format(
        start=DEFAULT_START, end=DEFAULT_END, form=form, tools=listed_tools
    )


def _spec(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function", tool)
    return {
        "name": function.get("name"),
        "description": function.get("description", ""),
        "parameters": function.get("parameters", {"type": "object", "properties": {}}),
    }


def _signature(tool: dict[str, Any]) -> str:
    """``Bash(command: string, timeout?: number): Executes a bash command.``"""
    function = tool.get("function", tool)
    schema = top_level(function.get("parameters") or {})
    required = set(schema.get("required", ()))
    parameters = ", ".join(
        f"{name}{'' if name in required else '?'}: {spec['type']}"
        for name, spec in schema["properties"].items()
    )
    line = f"{function.get('name')}({parameters})"
    description = first_sentence(function.get("description") or "")
    return f"{line}: {description}" if description else line


def _call_text(call: dict[str, Any]) -> str:
    function = call.get("function", call)
    arguments = function.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        parsed = arguments  # what the model wrote, as it wrote it
    body = json.dumps({"name": function.get("name"), "arguments": parsed}, ensure_ascii=False)
    return f"{DEFAULT_START}\n{body}\n{DEFAULT_END}"


def generic_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, listing: Listing = "full"
) -> list[dict[str, Any]]:
    """``messages`` with the tools in the (first) system message and every tool call and tool
    result written as text, for a template that renders neither."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            parts = [message.get("content") or "", *map(_call_text, message["tool_calls"])]
            rest = {k: v for k, v in message.items() if k not in ("tool_calls", "content")}
            out.append({**rest, "content": "\n".join(p for p in parts if p)})
        elif role == "tool":
            result = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            out.append({"role": "user", "content": result})
        else:
            out.append(message)
    if tools:
        section = tools_section(tools, listing)
        if out and out[0].get("role") == "system":
            system = out[0].get("content") or ""
            out[0] = {**out[0], "content": f"{system}\n\n{section}" if system else section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out
