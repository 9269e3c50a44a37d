"""Structured output in each client API → ``OutputFormat``, the schema checked before routing.

- Chat Completions: ``response_format`` ``{"type": "json_schema", "json_schema": {"name",
  "schema", "strict"}}`` or ``{"type": "json_object"}``.
- Responses: ``text.format`` ``{"type": "json_schema", "name", "schema", "strict"}`` or
  ``{"type": "json_object"}``.
- Messages: ``output_config.format`` ``{"type": "json_schema", "schema"}`` (also the beta's
  top-level ``output_format``).

Each schema is compiled here (worker/structured/json_grammar.py, no model needed), so a keyword the grammar
cannot enforce is a 400 in the client's API shape that names it
(``text.format.schema.properties.tags.uniqueItems``) before any worker is asked. The worker
compiles it again for its vocabulary and answers 400 itself for what only that shows.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.refusals import RequestInvalid, validated
from gateway.request import OutputFormat
from worker.chat.schemas import ResponseFormat
from worker.structured.json_grammar import SchemaError, json_grammar


def _checked(schema: dict[str, Any] | None, at: str, name: str | None = None) -> OutputFormat:
    try:
        json_grammar(schema)
    except SchemaError as exc:
        param = exc.param(f"{at}.schema") if schema is not None else at
        raise RequestInvalid(f"{param}: {exc.message}", param) from exc
    return OutputFormat(json_schema=schema, name=name)


def chat_output_format(response_format: ResponseFormat | None) -> OutputFormat | None:
    """Chat ``response_format`` (already validated with the body)."""
    if response_format is None or not response_format.is_json:
        return None
    spec = response_format.json_schema if response_format.type == "json_schema" else None
    out = _checked(
        response_format.schema_or_none,
        "response_format.json_schema" if spec is not None else "response_format",
        spec.name if spec is not None else None,
    )
    return out.model_copy(update={"strict": spec.strict}) if spec is not None else out


class _ResponsesFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)  # description

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


def responses_output_format(raw: dict[str, Any]) -> OutputFormat | None:
    """Responses ``text.format`` of the raw body (its type already validated with the body)."""
    text = raw.get("text")
    given = text.get("format") if isinstance(text, dict) else None
    if given is None:
        return None
    spec = validated(_ResponsesFormat, given, "text.format")
    if spec.type == "text":
        return None
    if spec.type == "json_object":
        return _checked(None, "text.format")
    if spec.schema_ is None:
        raise RequestInvalid(
            "text.format.schema: a json_schema format needs its schema", "text.format.schema"
        )
    out = _checked(spec.schema_, "text.format", spec.name)
    description = (spec.model_extra or {}).get("description")
    return out.model_copy(
        update={
            "strict": spec.strict,
            "description": description if isinstance(description, str) else None,
        }
    )


def responses_format_echo(output: OutputFormat | None) -> dict[str, Any]:
    """The response object's ``text.format``: what the request asked for. The schema is echoed
    as OpenAI does (its SDK requires it), where the Open Responses document has null."""
    if output is None:
        return {"type": "text"}
    if output.json_schema is None:
        return {"type": "json_object"}
    return {
        "type": "json_schema",
        "name": output.name or "response",
        "description": output.description,
        "schema": output.json_schema,
        "strict": bool(output.strict),
    }


class _AnthropicFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class _AnthropicOutputConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: _AnthropicFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


# Anthropic's effort levels as OpenAI's reasoning_effort, which chat templates read
# (gpt-oss's "Reasoning: high"); OpenAI's scale ends at xhigh.
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "xhigh"}


def messages_effort(raw: dict[str, Any]) -> str | None:
    """Messages ``output_config.effort`` as a ``reasoning_effort``."""
    if raw.get("output_config") is None:
        return None
    config = validated(_AnthropicOutputConfig, raw["output_config"], "output_config")
    return _EFFORTS[config.effort] if config.effort else None


def messages_output_format(raw: dict[str, Any]) -> OutputFormat | None:
    """Messages ``output_config.format`` of the raw body, else the beta's ``output_format``."""
    if raw.get("output_config") is not None:
        config = validated(_AnthropicOutputConfig, raw["output_config"], "output_config")
        if config.format is not None:
            return _checked(config.format.schema_, "output_config.format")
    if raw.get("output_format") is not None:
        spec = validated(_AnthropicFormat, raw["output_format"], "output_format")
        return _checked(spec.schema_, "output_format")
    return None
