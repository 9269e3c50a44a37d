"""Pydantic models of the worker's OpenAI chat-completions request (unknown fields allowed)."""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

# The chat template call's own parameters (transformers' ``apply_chat_template``, mlx-lm's
# wrapper) and the names the template is rendered with. Sent as ``chat_template_kwargs`` they
# collide with the call ("got multiple values for keyword argument") or silently change it
# (another template, tokenized output), so a request that names one is refused.
TEMPLATE_CALL_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)

# OpenAI documents ``seed`` as a signed 64-bit integer; the worker also takes the unsigned range
# its PRNG keys span, so a caller that adds to a seed (mixture-of-agents samples) stays valid.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


def check_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """``value`` unchanged, or a ValueError naming the first key the template call owns."""
    for key in value or ():
        if key in TEMPLATE_CALL_ARGUMENTS:
            raise ValueError(
                f"{key!r} is an argument of the chat template call, not a template variable"
            )
    return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "input_text", "output_text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = ""
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content

    def to_template(self) -> dict[str, Any]:
        """The dict a chat template expects (tool-call arguments as objects when they parse)."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text() or "",
        }
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                arguments: Any = call.function.arguments
                if isinstance(arguments, str):
                    try:
                        arguments = orjson.loads(arguments) if arguments.strip() else {}
                    except orjson.JSONDecodeError:
                        pass  # the template gets the model's own text back
                calls.append(
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": arguments},
                    }
                )
            out["tool_calls"] = calls
        return out


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    # vLLM's extension: usage (tokens so far) in every chunk, so a client knows the prompt's
    # size from the first chunk on (Anthropic's message_start reports it).
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``. ``strict`` is accepted and changes nothing: a schema
    given is always enforced (a keyword that cannot be enforced is refused)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    # ``schema`` would shadow BaseModel.schema: the attribute is named schema_.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI chat ``response_format``: text (the default), any JSON object, or a JSON schema."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a response_format of type 'json_schema' needs its json_schema")
        return self

    @property
    def is_json(self) -> bool:
        return self.type != "text"

    @property
    def schema_or_none(self) -> dict[str, Any] | None:
        """The schema to hold the answer to; None: any JSON object (``json_object``)."""
        if self.type == "json_schema" and self.json_schema is not None:
            return self.json_schema.schema_
        return None


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Any = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    # Without a temperature: the model's recommended one, but at least this (model=mesh's vote
    # samples: a very cold default makes every sample the greedy answer).
    min_temperature: float | None = Field(default=None, ge=0, le=2)
    # An extension: false when no next turn will follow this answer (model=mesh's extra
    # samples), so the worker does not prefill one (worker/chat/next_turn.py).
    cache_next_turn: bool = True
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    n: int | None = Field(default=None, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    reasoning: dict[str, Any] | bool | None = None
    thinking: dict[str, Any] | bool | None = None
    thinking_budget: int | None = None
    response_format: ResponseFormat | None = None

    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 16:
            raise ValueError("at most 16 stop strings")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def logit_bias_ids(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(k): max(-100.0, min(100.0, v)) for k, v in self.logit_bias.items()}
        except ValueError:
            raise ValueError("logit_bias keys must be token ids") from None


def describe_validation_error(exc: ValidationError) -> tuple[str, str]:
    """(param, message) for the first error, the field written as a dotted path."""
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or "body"
    return param, f"invalid field '{param}': {first['msg']}"


def openai_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The OpenAI chat ``usage`` object (the worker's and the gateway's chat responses alike)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
