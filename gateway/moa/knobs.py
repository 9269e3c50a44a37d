"""Thinking is off for every worker call unless the caller opted in through a recognised knob.

The API parsers already normalise Responses ``reasoning.effort`` and Anthropic ``thinking`` into
``ChatRequest.reasoning`` / ``reasoning_effort``; templates' own switches arrive untouched in
``chat_template_kwargs``. Mixture-of-agents runs several workers at once, so a thinking pass on
each would multiply latency for no visible benefit: off unless asked.
"""

from __future__ import annotations

from typing import Any

from gateway.request import ChatRequest
from worker.thinking import THINKING_ALIASES

# chat_template_kwargs keys that templates use to switch thinking on or off: the worker's
# aliases plus the bare names some templates read.
THINKING_SWITCHES = (*THINKING_ALIASES, "thinking", "reasoning")
THINKING_BUDGETS = ("thinking_budget", "reasoning_budget", "max_thinking_tokens")
OFF_EFFORTS = (None, "none")


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("", "0", "false", "no", "off", "none", "disabled")
    if isinstance(value, dict):  # e.g. {"type": "enabled", "budget_tokens": ...}
        return str(value.get("type", "enabled")).lower() != "disabled"
    return bool(value)


def thinking_opted_in(request: ChatRequest) -> bool:
    """True when the caller asked for thinking by any knob we recognise.

    An explicit ``reasoning=False`` wins over everything else: the parsers set it when the caller
    turned thinking off on purpose.
    """
    if request.reasoning is False:
        return False
    if request.reasoning is True:
        return True
    if request.reasoning_effort not in OFF_EFFORTS:
        return True
    kwargs = request.chat_template_kwargs
    if any(key in kwargs and _truthy(kwargs[key]) for key in THINKING_SWITCHES):
        return True
    return any(
        isinstance(kwargs.get(key), int | float) and kwargs[key] > 0 for key in THINKING_BUDGETS
    )


def with_thinking(request: ChatRequest, enabled: bool) -> ChatRequest:
    """A copy of ``request`` whose every thinking knob says ``enabled``."""
    kwargs = dict(request.chat_template_kwargs)
    # Every switch the caller used says the same thing, plus the common one templates read.
    for key in THINKING_SWITCHES:
        if key in kwargs:
            kwargs[key] = enabled
    kwargs["enable_thinking"] = enabled
    if not enabled:
        for key in THINKING_BUDGETS:
            kwargs.pop(key, None)
        return request.model_copy(
            update={"reasoning": False, "reasoning_effort": "none", "chat_template_kwargs": kwargs}
        )
    effort = request.reasoning_effort if request.reasoning_effort not in OFF_EFFORTS else "medium"
    return request.model_copy(
        update={"reasoning": True, "reasoning_effort": effort, "chat_template_kwargs": kwargs}
    )
