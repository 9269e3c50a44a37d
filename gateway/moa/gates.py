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
# How refusals open (lower case, straight apostrophes).
REFUSAL_OPENINGS = (
    "i'm sorry",
    "im sorry",
    "i am sorry",
    "sorry,",
    "sorry but",
    "i cannot",
    "i can't",
    "i can not",
    "i won't",
    "i will not",
    "i am unable",
    "i'm unable",
    "i am not able",
    "i'm not able",
    "as an ai",
    "i apologize",
    "i apologise",
)
_LEAD = re.compile(r"^[\W_]+")
_SPACE = re.compile(r"\s+")


def _opening(text: str) -> str:
    text = text.replace("’", "'").lower()
    return _SPACE.sub(" ", _LEAD.sub("", text))


class Verdict(enum.Enum):
    PASS = "pass"
    REFUSAL = "refusal"  # acceptable only when nobody else answers
    EMPTY = "empty"
    MARKUP = "markup"
    REPETITION = "repetition"


def has_leaked_markup(text: str) -> bool:
    return _MARKUP.search(text) is not None


def is_refusal(text: str) -> bool:
    opening = _opening(text)
    return any(opening.startswith(p) for p in REFUSAL_OPENINGS)


def is_conclusive(text: str) -> bool:
    """True when more tokens cannot change the opening gates' verdict: the text has content,
    cannot still grow into a refusal opening ("I" might become "I'm sorry"; "The" cannot), and
    does not end in what may be the start of markup ("<thi…")."""
    opening = _opening(text)
    if not opening.strip():
        return False
    if is_refusal(text):
        return True
    if any(p.startswith(opening) for p in REFUSAL_OPENINGS):
        return False
    dangling = text.rfind("<")
    return dangling == -1 or ">" in text[dangling:] or len(text) - dangling > 16


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
