"""Does a few-shot example in the generic tool prompt help the default model call tools?

Runs the worker's own job path (``worker.chat.job.start_job``: tool listing, generic prompt,
parser) in process on SmolLM2-135M (``mesh models pull smollm2-135m``), greedy, with the generic
tool prompt as it is and with a short example call added, on

- simple tool questions (weather, calculator, …: a call is expected) and a few questions that
  need no tool (no call expected), each with the same four tools offered;
- the captured agent requests in tests/fixtures (Claude Code, Codex, OpenCode), turned into
  worker requests by the gateway's own parsers: for each, whether the model calls, and whether
  what it writes between ``<tool_call>`` tags parses (a call to an offered tool).

    python bench/tool_prompt.py [--model DIR] [--max-tokens 96] [--out bench/results/tool-prompt.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from gateway.api import chat, messages
from gateway.responses import request as responses_request
from gateway.worker_client import worker_body
from worker.chat.job import start_job
from worker.chat.prompt import ChatTemplate
from worker.chat.schemas import ChatCompletionRequest
from worker.engine.core import Engine
from worker.engine.types import TokenChunk
from worker.tools import prompt as tool_prompt

FIXTURES = Path(__file__).parents[1] / "tests" / "fixtures"
BASE = tool_prompt.GENERIC_TOOL_PROMPT
EXAMPLE = """

Example: asked "How warm is it in Oslo?" with a tool get_temperature(city: string), answer:
{start}
{{"name": "get_temperature", "arguments": {{"city": "Oslo"}}}}
{end}"""
FEW_SHOT = BASE.replace("\n\nAvailable tools", EXAMPLE + "\n\nAvailable tools")


def _tool(name: str, description: str, **properties: str) -> dict[str, Any]:
    schema = {k: {"type": v} for k, v in properties.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": schema, "required": list(schema)},
        },
    }


TOOLS = [
    _tool("get_weather", "Get the current weather for a city.", city="string"),
    _tool("calculator", "Evaluate an arithmetic expression.", expression="string"),
    _tool("get_time", "Get the current time in a timezone.", timezone="string"),
    _tool("search_web", "Search the web for a query.", query="string"),
]
CALL = [
    "What is the weather in Paris?",
    "What's the weather like in Tokyo right now?",
    "What is 1234 * 5678?",
    "Calculate 17% of 250.",
    "What time is it in New York?",
    "Search the web for the latest news about MLX.",
]
NO_CALL = ["Hi! How are you?", "Write a haiku about the sea.", "What is the capital of France?"]


def _agent_requests() -> dict[str, dict[str, Any]]:
    """name → worker request body, for every captured agent request that offers tools."""
    out: dict[str, dict[str, Any]] = {}
    for harness, parse in (("claude_code", messages.parse), ("opencode", chat.parse)):
        captured = json.loads((FIXTURES / f"{harness}_requests.json").read_text())
        for turn, entry in captured.items():
            if isinstance(entry, dict) and "body" in entry:
                request, _ = parse(entry["body"])
                if request.tools:
                    out[f"{harness}/{turn}"] = worker_body(request, "m")
    codex = json.loads((FIXTURES / "codex_requests.json").read_text())
    for turn, body in codex.items():
        if isinstance(body, dict):
            request, _ = responses_request.parse(body)
            out[f"codex/{turn}"] = worker_body(request, "m")
    return out


async def _answer(engine: Engine, body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    body = {**body, "stream": False, "temperature": 0.0, "max_tokens": max_tokens}
    body.pop("stream_options", None)
    job, assembler, listing, _ = await start_job(
        engine, ChatTemplate(engine.tokenizer), ChatCompletionRequest(**body), body
    )
    async for event in job.events():
        if isinstance(event, TokenChunk):
            assembler.feed(event.text)
    assembler.finish()
    offered = {t["function"]["name"] for t in body.get("tools") or ()}
    content = "".join(assembler.content)
    calls = assembler.tool_calls
    return {
        "called": bool(calls),
        "valid": bool(calls) and all(c.name in offered for c in calls),
        "unparsed": "<tool_call>" in content,  # a call the parser gave back as text
        "names": [c.name for c in calls],
        "listing": listing,
    }


async def _run(model: str, max_tokens: int) -> dict[str, dict[str, dict[str, Any]]]:
    engine = Engine(model)
    engine.start(timeout=300)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    agents = _agent_requests()
    try:
        for variant, text in (("base", BASE), ("few-shot", FEW_SHOT)):
            tool_prompt.GENERIC_TOOL_PROMPT = text
            rows: dict[str, dict[str, Any]] = {}
            for question in CALL + NO_CALL:
                body = {"messages": [{"role": "user", "content": question}], "tools": TOOLS}
                rows[question] = await _answer(engine, body, max_tokens)
            for name, body in agents.items():
                started = time.monotonic()
                rows[name] = await _answer(engine, body, max_tokens)
                rows[name]["seconds"] = round(time.monotonic() - started, 1)
            results[variant] = rows
            print(variant, json.dumps(rows, indent=1))
    finally:
        tool_prompt.GENERIC_TOOL_PROMPT = BASE
        engine.close()
    return results


def _table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = ["| request | expected | base | few-shot |", "|---|---|---|---|"]

    def cell(row: dict[str, Any]) -> str:
        if row["called"]:
            return ("call " if row["valid"] else "bad call ") + ",".join(row["names"])
        return "unparsed call" if row["unparsed"] else "no call"

    for name, base in results["base"].items():
        expected = "call" if name in CALL else "no call" if name in NO_CALL else "–"
        lines.append(f"| {name} | {expected} | {cell(base)} | {cell(results['few-shot'][name])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path.home() / ".mlx-mesh/models/smollm2-135m"))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = asyncio.run(_run(args.model, args.max_tokens))
    table = _table(results)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
