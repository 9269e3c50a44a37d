"""``auto``: the policy a ``mesh`` request gets from what it asks, decided from the request alone.

``race`` (the first good opening, streamed at once) for agent turns and open chat; for
short-answer questions ``single`` – the best model's one answer, greedy unless the caller set a
temperature – or, with ``MoaConfig.auto_vote``, ``vote`` (several samples, the majority answer).
The vote beat one answer on new items of the task families it was tuned on
(bench/results/moa-quality.md) but not on families no rule was tuned on, where it made the
user wait 2-4x as long (bench/results/moa-heldout.md); so ``auto`` does not pay for it unless
told.
The rule, first that applies:

1. ``race`` – an agent turn: tools offered, tool results in the conversation, structured output
   (JSON), or a long answer allowed (``max_tokens`` over :data:`LONG_ANSWER_TOKENS`);
2. ``single`` (``vote``) – the last user message asks for a short answer: an instruction such as
   "answer with the number only", "just the letter", "final answer", ``\\boxed``; or lettered
   options (two or more lines such as "A) …", "(B) …"); or arithmetic to work out in a short
   message ("what is 17 * 3?");
3. ``race`` – everything else (open chat).

``metadata.moa_policy`` overrides the rule (``"vote"`` asks for the vote).
"""

from __future__ import annotations

import re

from gateway.moa.config import Policy
from gateway.request import ChatRequest

LONG_ANSWER_TOKENS = 1024
# A question this long is rarely a short-answer one, whatever it contains.
MAX_QUESTION_CHARS = 4000

_SHORT_INSTRUCTION = re.compile(
    r"\b(?:answer|respond|reply|output|give|return|write)\b[^.\n?]{0,40}?"
    r"\b(?:only|just|single|one word|a number|the number|the letter|the option|integer)\b"
    r"|\bfinal answer\b|\\boxed|\bno explanation\b|\bwithout explanation\b",
    re.IGNORECASE,
)
_OPTION = re.compile(r"^\s*(?:\(?[A-Ea-e]\)|[A-E][.:])\s+\S", re.MULTILINE)
# "17 * 3", "7*(3-1)", "12 - 5"; not a date or a range ("1939-1945", "2024-01-05").
_ARITHMETIC = re.compile(r"\d\s*(?:[+*/×÷^%]|\*\*|\s-\s)\s*\(?\s*-?\d")
MAX_ARITHMETIC_CHARS = 300  # a short question: arithmetic inside an essay prompt is not one


def last_user_text(request: ChatRequest) -> str:
    """The last user message's text (empty when there is none)."""
    for message in reversed(request.messages):
        if message.role == "user":
            return message.content
    return ""


def choose_policy(request: ChatRequest, *, vote: bool = False) -> tuple[Policy, str]:
    """The policy for ``request`` and the rule that chose it (for the ``x-moa-auto`` header);
    ``vote``: short-answer questions get the vote instead of one answer."""
    if request.tools or any(m.role == "tool" or m.tool_calls for m in request.messages):
        return "race", "agent"
    if request.output_format is not None:
        return "race", "structured"
    if request.max_tokens is not None and request.max_tokens > LONG_ANSWER_TOKENS:
        return "race", "long"
    text = last_user_text(request)
    if not text or len(text) > MAX_QUESTION_CHARS:
        return "race", "open"
    short: Policy = "vote" if vote else "single"
    if _SHORT_INSTRUCTION.search(text):
        return short, "short-answer"
    if len(_OPTION.findall(text)) >= 2:
        return short, "choices"
    if len(text) <= MAX_ARITHMETIC_CHARS and _ARITHMETIC.search(text):
        return short, "arithmetic"
    return "race", "open"
