"""Thinking is off for every worker call unless the caller opted in through a recognised knob.

The API parsers normalise every knob once (``worker.chat.thinking.normalize_thinking``) into
``ChatRequest.reasoning``; this module only reads that result. Mixture-of-agents runs several
workers at once, so a thinking pass on each would multiply latency for no visible benefit: off
unless asked.
"""

from __future__ import annotations

from gateway.request import ChatRequest
from worker.chat.thinking import THINKING_BUDGETS, THINKING_SWITCHES

OFF_EFFORTS = (None, "none")


def thinking_opted_in(request: ChatRequest) -> bool:
    """True when the caller asked for thinking (by any knob: the parsers normalised them all)."""
    return request.reasoning is True


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
