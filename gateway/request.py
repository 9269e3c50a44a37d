"""The one internal request every client API is parsed into, and every upstream receives.

It is also the body a node forwards to a peer through the tunnel, so it is a pydantic model.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Integers reach the worker as JSON written by orjson, which holds 64 bits; a bigger one (JSON
# numbers like 1e30 validate as ints) would fail there, so the client APIs' bodies refuse them.
INT64_MAX = 2**63 - 1


class ToolCall(BaseModel):
    id: str
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI carries it


class Message(BaseModel):
    """One turn. Content is plain text; tool results are ``role="tool"`` with ``tool_call_id``."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None


class ToolSpec(BaseModel):
    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class OutputFormat(BaseModel):
    """Structured output: the answer is one JSON value held to ``json_schema`` (any JSON object
    when None). The client APIs check the schema before this is built (gateway/api/output_format.py)."""

    json_schema: dict[str, Any] | None = None
    name: str | None = None
    description: str | None = None
    strict: bool | None = None


class ChatRequest(BaseModel):
    """What the caller asked for, independent of the API it used.

    ``reasoning`` is the normalised thinking setting: True (on), False (off), None (model default).
    ``chat_template_kwargs`` are passed through to the worker's chat template untouched.
    ``output_format`` holds the answer to JSON (then the worker turns thinking off).
    """

    model: str
    messages: list[Message]
    tools: list[ToolSpec] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = None
    # Without a temperature: the model's recommended one, but at least this (set by model=mesh
    # for its vote samples, never by a client API).
    min_temperature: float | None = None
    # Whether the worker brings this answer's cache to the next turn's tokens after the
    # response; model=mesh's extra samples, its reducer and judge never have a next turn.
    cache_next_turn: bool = True
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: list[str] = Field(default_factory=list)
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] = Field(default_factory=dict)  # token id → bias
    reasoning: bool | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    output_format: OutputFormat | None = None
    # Chat ``logprobs``: each answer token's log-probability, and with ``top_logprobs`` (0-20)
    # that many of the likeliest tokens at its position (events: ``TextDelta.logprobs``).
    logprobs: bool = False
    top_logprobs: int | None = None
    stream: bool = True
    session_key: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    # Response headers saying what the gateway changed in the request on its way to the model
    # (e.g. ``x-content-replaced``), so a client can tell; never sent to the model.
    notes: dict[str, str] = Field(default_factory=dict)
