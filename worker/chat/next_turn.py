"""An answer's conversation as the next turn will tokenize it, for the prompt cache.

A finished answer's KV cache holds the prompt and the tokens the model *generated*. The next turn
sends the answer back as text, and the chat template renders and tokenizes it again: a sampled
answer often re-tokenizes differently (``"prefill`` generated as ``"`` + ``pre`` + ``fill``,
encoded as `` "`` + ``prefill``), a template drops the think block of past turns, and the turn's
closing tokens were never generated. From the first such token on, the cached answer is of no use
to the next turn (issue 45: 2 of 20 turn 2s got only 0.86 of their prompt from cache).

:class:`NextTurn` renders the conversation with the answer closed, as a next user turn would
show it: the tokens that two renderings with different next messages share. The engine
prefills what they add to its cache after the response (worker/engine/next_turns.py).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from worker.chat.prompt import ChatTemplate
from worker.chat.schemas import Message
from worker.engine.core import Engine, Job
from worker.prompt_cache.digest import common_prefix
from worker.tools.listing import Listing

log = logging.getLogger(__name__)

# Two next messages that share no first token: what both renderings hold is the conversation.
_PROBES = ("Alpha?", "Zulu!")


@dataclass(frozen=True)
class NextTurn:
    """What the answer's request rendered: the template, its messages, tools and options."""

    template: ChatTemplate
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]
    listing: Listing

    def tokens(self, answer: dict[str, Any]) -> list[int]:
        """The next turn's prompt tokens through ``answer`` (the assistant message as the
        response carried it) and the turn's close; the reasoning stays out, as clients send
        answers back without it. Raises what the template raises."""
        sent = {"role": "assistant", "content": answer.get("content") or ""}
        if answer.get("tool_calls"):
            sent["tool_calls"] = answer["tool_calls"]
        assistant = Message.model_validate(sent).to_template()
        rendered = [
            self.template.render(
                [*self.messages, assistant, {"role": "user", "content": probe}],
                self.tools,
                self.template_kwargs,
                self.listing,
            )[0]
            for probe in _PROBES
        ]
        return rendered[0][: common_prefix(*rendered)]


async def commit_answer(
    engine: Engine, job: Job, turn: NextTurn | None, answer: dict[str, Any]
) -> None:
    """Ask the engine to commit ``job``'s cache, with the next turn's tokens when ``turn``
    renders them (off the event loop: a long conversation takes milliseconds)."""
    tokens = None
    if turn is not None and job.done:
        try:
            tokens = await asyncio.to_thread(turn.tokens, answer)
        except Exception:  # the cache lands as it is; the next turn prefills the rest
            log.warning("cannot render the next turn of job %s", job.id, exc_info=True)
    engine.commit(job, tokens)


_COMMITTING: set[asyncio.Task[None]] = set()  # held until done: the loop keeps weak references


def commit_soon(engine: Engine, job: Job, turn: NextTurn | None, answer: dict[str, Any]) -> None:
    """:func:`commit_answer` in a task of its own, for a caller that cannot wait (a stream's
    generator, closing)."""
    task = asyncio.get_running_loop().create_task(commit_answer(engine, job, turn, answer))
    _COMMITTING.add(task)
    task.add_done_callback(_COMMITTING.discard)
