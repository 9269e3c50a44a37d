"""The Responses object and its output items, as the Open Responses specification has them: the
fields a response carries whatever happens (:class:`ResponseShell`), usage, and the items the
stream encoder (:mod:`gateway.responses.wire`) opens and finishes."""

from __future__ import annotations

import time
from typing import Any

from gateway.answer import Accumulator, ToolCallState, new_id
from gateway.api.output_format import responses_format_echo
from gateway.events import Error
from gateway.request import ChatRequest
from gateway.responses.compacted import encode_reasoning
from gateway.responses.request import FunctionChoice, ResponsesBody
from gateway.responses.tools import ServedTool, custom_input

# -- the response object and its items ---------------------------------------------------------------------------

# What the spec (and OpenAI) default temperature and top_p to: reported when neither the request
# nor the upstream said what was used.
_DEFAULT_SAMPLING = 1.0
_EFFORTS = {"none", "low", "medium", "high", "xhigh"}  # the spec's ReasoningEffortEnum


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def usage_of(acc: Accumulator) -> dict[str, Any]:
    return {
        "input_tokens": acc.prompt_tokens,
        # cache_write_tokens is not in the spec; OpenAI's SDK requires it (always 0 here).
        "input_tokens_details": {"cached_tokens": acc.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": acc.completion_tokens,
        "output_tokens_details": {
            "reasoning_tokens": min(acc.reasoning_deltas, acc.completion_tokens)
        },
        "total_tokens": acc.prompt_tokens + acc.completion_tokens,
    }


def _failure(error: Error) -> dict[str, Any]:
    """The spec's ``Error`` of a failed response (codes from OpenAI's set)."""
    code = "rate_limit_exceeded" if error.kind == "overloaded" else "server_error"
    return {"code": code, "message": error.message}


def _tool_choice(body: ResponsesBody) -> Any:
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "name": choice.name}
    return choice or "auto"


def _reasoning(body: ResponsesBody) -> dict[str, Any]:
    effort = body.reasoning.effort if body.reasoning else None
    summary = body.reasoning.summary if body.reasoning else None
    return {"effort": effort if effort in _EFFORTS else None, "summary": summary}


class ResponseShell:
    """The response object's fixed fields, in the spec's order: what the request said, defaults
    for what it left out. ``temperature`` and ``top_p`` are the values used once the upstream
    said them (``Sampling``); until then (``response.created``) the request's, else 1.0."""

    def __init__(
        self, request: ChatRequest, body: ResponsesBody, response_id: str | None = None
    ) -> None:
        self.id = response_id or body._response_id
        self.created_at = int(time.time())
        text: dict[str, Any] = {"format": responses_format_echo(request.output_format)}
        text["verbosity"] = (body.text.verbosity if body.text else None) or "medium"
        self.fields: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": None,
            "status": "in_progress",
            "incomplete_details": None,
            "model": request.model,
            "previous_response_id": body.previous_response_id,
            "instructions": body.instructions,
            "output": [],
            "error": None,
            "tools": body._tools.echo,  # as the model saw them (gateway.responses.tools)
            "tool_choice": _tool_choice(body),
            "truncation": body.truncation or "disabled",
            "parallel_tool_calls": _or(body.parallel_tool_calls, True),
            "text": text,
            "top_p": _or(request.top_p, _DEFAULT_SAMPLING),
            "presence_penalty": _or(body.presence_penalty, 0.0),
            "frequency_penalty": _or(body.frequency_penalty, 0.0),
            "top_logprobs": _or(body.top_logprobs, 0),
            "temperature": _or(request.temperature, _DEFAULT_SAMPLING),
            "reasoning": _reasoning(body),
            "usage": None,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls,
            "store": _or(body.store, True),
            "background": bool(body.background),
            "service_tier": "default",  # the tier used: the only one there is
            "metadata": body.metadata or {},
            "safety_identifier": body.safety_identifier,
            "prompt_cache_key": body.prompt_cache_key,
        }

    def response(
        self, status: str, output: list[dict[str, Any]], acc: Accumulator | None = None
    ) -> dict[str, Any]:
        out = dict(self.fields, status=status, output=output)
        if acc is None:
            return out
        if acc.usage is not None:
            out["usage"] = usage_of(acc)
        if acc.sampling is not None:
            out["temperature"] = acc.sampling.temperature
            out["top_p"] = acc.sampling.top_p
        if status == "completed":
            out["completed_at"] = int(time.time())
        elif status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if acc.error is not None:
            out["error"] = _failure(acc.error)
        if any(key.startswith(MOA_PREFIX) for key in acc.meta):
            out["metadata"] = moa_metadata(out["metadata"], acc.meta)
        return out


MOA_PREFIX = "x-moa-"
METADATA_PAIRS, METADATA_VALUE_CHARS = 16, 512  # the spec's MetadataParam limits


def moa_metadata(metadata: dict[str, str], meta: dict[str, str]) -> dict[str, str]:
    """The caller's ``metadata`` plus ``model="mesh"``'s decision facts (``x-moa-votes`` →
    ``moa_votes`` …), within the spec's limits (the caller's own pairs first)."""
    out = dict(metadata)
    for key, value in meta.items():
        if key.startswith(MOA_PREFIX) and len(out) < METADATA_PAIRS:
            out["moa_" + key[len(MOA_PREFIX) :].replace("-", "_")] = value[:METADATA_VALUE_CHARS]
    return out


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def summary_part(text: str) -> dict[str, Any]:
    return {"type": "summary_text", "text": text}


def reasoning_item(text: str, encrypted: bool) -> dict[str, Any]:
    """The model's reasoning as an output item; with ``encrypted``, also encoded for a client
    that keeps nothing to hand back (``include: ["reasoning.encrypted_content"]``)."""
    item = {"type": "reasoning", "id": new_id("rs_"), "summary": [], "content": []}
    return finish_reasoning(item, text, encrypted)


def finish_reasoning(item: dict[str, Any], text: str, encrypted: bool) -> dict[str, Any]:
    done = dict(item, content=[reasoning_part(text)])
    if encrypted:
        done["encrypted_content"] = encode_reasoning(text)
    return done


CALL_KINDS = ("function_call", "custom_tool_call")


def call_item(call: ToolCallState, served: dict[str, ServedTool]) -> dict[str, Any]:
    """A tool call's output item as it opens: the client's name for the tool (and its namespace,
    OpenAI's field), and OpenAI's ``custom_tool_call`` for a custom tool, plain-text ``input``."""
    tool = served.get(call.name)
    name = tool.name if tool is not None else call.name
    if tool is not None and tool.custom:
        item = {"type": "custom_tool_call", "id": new_id("ctc_"), "call_id": call.id, "name": name}
    else:
        item = {"type": "function_call", "id": new_id("fc_"), "call_id": call.id, "name": name}
    if tool is not None and tool.namespace is not None:
        item["namespace"] = tool.namespace
    if item["type"] == "custom_tool_call":
        return dict(item, input="")
    return dict(item, arguments="", status="in_progress")


def finish_call(item: dict[str, Any], arguments: str, status: str) -> dict[str, Any]:
    if item["type"] == "custom_tool_call":
        return dict(item, input=custom_input(arguments))
    return dict(item, arguments=arguments, status=status)
