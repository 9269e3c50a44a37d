"""Quality gates: cheap, pure checks on the first tokens of a worker's answer.

A worker that fails a gate is never committed while another worker is still in the running; a
refusal is held back only while some other worker may still answer.
"""

from __future__ import annotations

import enum
import re

# Leaked reasoning or chat markup: the worker's parser should have split or stripped it.
_MARKUP = re.compile(
    r"</?\s*(think|thinking|reasoning|reflection)\s*>|<\|(im_start|im_end|endoftext|channel)\|>",
    re.IGNORECASE,
)
_REFUSAL = re.compile(
    r"^\W*(i'?m sorry|i am sorry|sorry,|i (?:cannot|can't|can not|won't|will not|am unable|"
    r"am not able|'m unable|'m not able)|as an ai\b|i apologi[sz]e)",
    re.IGNORECASE,
)


class Verdict(enum.Enum):
    PASS = "pass"
    REFUSAL = "refusal"  # acceptable only when nobody else answers
    EMPTY = "empty"
    MARKUP = "markup"
    REPETITION = "repetition"


def has_leaked_markup(text: str) -> bool:
    return _MARKUP.search(text) is not None


def is_refusal(text: str) -> bool:
    return _REFUSAL.match(text.replace("’", "'")) is not None


def is_repetition_loop(text: str, *, max_period: int = 40, window: int = 400) -> bool:
    """True when the text ends in the same short unit repeated over and over.

    A unit of one or two characters must repeat 16 times ("!!!!…", "ababab…"); longer units
    (words, phrases) 3.5 times and over at least 24 characters. Short legitimate runs ("1000",
    "---", "ha ha ha") stay below both bars. Only the last ``window`` characters are examined.
    """
    tail = text[-window:]
    n = len(tail)
    for period in range(1, min(max_period, n // 2) + 1):
        if not tail[n - period :].strip():
            continue
        # Walk back while the text stays periodic with this period.
        j = n - period - 1
        while j >= 0 and tail[j] == tail[j + period]:
            j -= 1
        span = n - 1 - j
        if period <= 2 and span >= 16 * period:
            return True
        if period > 2 and span >= 3.5 * period and span >= 24:
            return True
    return False


def judge(text: str, *, reasoning: str = "", tool_calls: int = 0) -> Verdict:
    """The verdict on a worker's output so far (text channel first; reasoning or a tool call
    counts as an answer when the text channel is still empty)."""
    if tool_calls:
        return Verdict.PASS
    body = text if text.strip() else reasoning
    if not body.strip():
        return Verdict.EMPTY
    if has_leaked_markup(text):
        return Verdict.MARKUP
    if is_repetition_loop(body):
        return Verdict.REPETITION
    if text.strip() and is_refusal(text):
        return Verdict.REFUSAL
    return Verdict.PASS
