"""A conversation as prompt tokens: the chat template, with tools shown natively or as text.

The engine takes token ids; this is where a chat request's messages become them
(:class:`ChatTemplate`, one per loaded model)."""

from __future__ import annotations

import functools
from typing import Any

from worker.tools.listing import Listing, listed
from worker.tools.prompt import generic_messages, renders_tools


def template_tool_calling(tok: Any) -> str:
    """ "native" when the tokenizer's chat template shows the model tools and past calls, else
    "generic" (worker.tools.prompt writes them into the prompt as text)."""
    if not tok.has_chat_template:
        return "generic"

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )

    return "native" if renders_tools(render) else "generic"


class ChatTemplate:
    """A loaded model's chat template: renders a conversation to prompt tokens. Whether it
    shows tools natively is found once, when a conversation first has tools or tool turns."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @functools.cached_property
    def tool_calling(self) -> str:
        """ "native" or "generic" (:func:`template_tool_calling`)."""
        return template_tool_calling(self.tokenizer)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
        listing: Listing = "full",
    ) -> tuple[list[int], bool]:
        """Prompt tokens and whether generation starts in a think block
        (:func:`render_prompt`). Raises jinja errors for bad conversations."""
        tool_calling = self.tool_calling if tools or _has_tool_turns(messages) else "native"
        return render_prompt(
            self.tokenizer, tool_calling, messages, tools, template_kwargs, listing
        )


def render_prompt(
    tok: Any,
    tool_calling: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any],
    listing: Listing = "full",
) -> tuple[list[int], bool]:
    """Prompt tokens through the chat template, and whether generation starts in a think
    block (the template opened ``<think>``), the tools shown as ``listing``
    (:mod:`worker.tools.listing`); ``tool_calling`` as :func:`template_tool_calling` found.
    Raises jinja errors for bad conversations."""
    if tool_calling == "generic" and (tools or _has_tool_turns(messages)):
        messages, tools = generic_messages(messages, tools, listing), None
    elif tools:
        tools = listed(tools, listing)
    if tok.has_chat_template:
        text = tok.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=True,
            tokenize=False,
            **template_kwargs,
        )
    else:
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
        text += "assistant: "
    in_reasoning = False
    if tok.has_thinking:
        in_reasoning = text.rfind(tok.think_start) > text.rfind(tok.think_end)
    tokens = list(tok.encode(text, add_special_tokens=False))
    return tokens, in_reasoning


def _has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
