"""Structured output in the worker: what a request's ``response_format`` changes about its job.

- ``output_grammar``: the llguidance grammar for ``json_schema`` / ``json_object`` (None for
  text), checked before anything runs; a schema that cannot be enforced is an
  ``OutputFormatError`` naming the field (the app answers 400).
- Thinking is off for such a request: the grammar holds the answer, and a think block before
  it would have to be JSON too. The app renders the template with ``enable_thinking`` false,
  and ``answer_prompt`` closes a think block that a template opens regardless.
- ``agrammar_processor``: the request's own logits processor, built off the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from worker.chat.schemas import ResponseFormat
from worker.structured.json_grammar import SchemaError, json_grammar
from worker.structured.processor import GrammarProcessor, GrammarUnavailable, make_grammar_processor

_SCHEMA_PARAM = "response_format.json_schema.schema"


class OutputFormatError(ValueError):
    """A ``response_format`` that cannot be served; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def output_grammar(response_format: ResponseFormat | None, tools_offered: bool) -> str | None:
    """The grammar the answer is held to, or None for free text."""
    if response_format is None or not response_format.is_json:
        return None
    if tools_offered:
        raise OutputFormatError(
            "tools: a JSON output format cannot be combined with tools (an answer held to "
            "the schema cannot call one); send no tools or tool_choice 'none'",
            "tools",
        )
    schema = response_format.schema_or_none
    try:
        return json_grammar(schema)
    except SchemaError as exc:
        param = exc.param(_SCHEMA_PARAM) if schema is not None else "response_format"
        raise OutputFormatError(f"{param}: {exc.message}", param) from exc


def answer_prompt(tokenizer: Any, prompt: list[int], in_reasoning: bool) -> list[int]:
    """``prompt`` with the think block closed when the template left one open (some templates
    open it whatever ``enable_thinking`` says): generation starts at the answer."""
    if not in_reasoning:
        return prompt
    close = tokenizer.encode(f"{tokenizer.think_end}\n\n", add_special_tokens=False)
    return [*prompt, *close]


async def agrammar_processor(tokenizer: Any, grammar: str) -> GrammarProcessor:
    """The processor for one request (the first one for a model also builds its vocabulary's
    llguidance tokenizer, ~0.5 s); OutputFormatError when the model's vocabulary cannot
    express the grammar or its tokenizer cannot be read."""
    try:
        return await asyncio.to_thread(make_grammar_processor, tokenizer, grammar)
    except SchemaError as exc:
        raise OutputFormatError(f"{_SCHEMA_PARAM}: {exc.message}", _SCHEMA_PARAM) from exc
    except GrammarUnavailable as exc:
        raise OutputFormatError(f"response_format: {exc}", "response_format") from exc
