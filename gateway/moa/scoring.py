"""Pure scoring helpers for the consensus and reduce policies: answer normalisation, agreement
between workers, a per-stream score and the running win rate of each model."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field

_MARKDOWN = re.compile(r"[*_`#>]+")
_SPACE = re.compile(r"\s+")
# Leading punctuation goes, except the minus of a negative number; trailing, sentence punctuation
# and quotes ('The answer is "True".' votes with "True"); a closing bracket only when unbalanced.
_LEADING_PUNCT = re.compile(r"^(?:[^\w-]|-(?!\d))+")
_TRAILING_PUNCT = re.compile(r"[\s.!?,;:\"'`\u2018\u2019\u201c\u201d\u00ab\u00bb]+$")
_DECIMAL = re.compile(r"^-?\d+\.\d+$")


def normalize_answer(text: str) -> str:
    """Lower-case, markdown and surrounding punctuation stripped, whitespace collapsed, so that
    "**42**." and "42" compare equal."""
    text = unicodedata.normalize("NFKC", text)
    text = _MARKDOWN.sub("", text).lower()
    text = _strip_edges(_SPACE.sub(" ", text).strip())
    if _DECIMAL.match(text):  # "3.50" == "3.5", "4.0" == "4"
        text = text.rstrip("0").rstrip(".")
    return text


def _strip_edges(text: str) -> str:
    while True:
        before = text
        text = _TRAILING_PUNCT.sub("", _LEADING_PUNCT.sub("", text))
        for opener, closer in ("()", "[]", "{}"):
            if text.endswith(closer) and text.count(closer) > text.count(opener):
                text = text[:-1]
        if text == before:
            return text


def common_prefix_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def agreeing_groups(answers: dict[str, str]) -> list[list[str]]:
    """Workers grouped by equal normalised answer, largest group first (ties: first seen)."""
    groups: dict[str, list[str]] = {}
    for worker, answer in answers.items():
        groups.setdefault(normalize_answer(answer), []).append(worker)
    return sorted(groups.values(), key=len, reverse=True)


def prefix_agreement(texts: dict[str, str], min_chars: int) -> list[str]:
    """The largest set of workers whose normalised texts share ``min_chars`` leading characters
    (empty when no two do)."""
    normalised = {w: normalize_answer(t) for w, t in texts.items()}
    best: list[str] = []
    for text in normalised.values():
        if len(text) < min_chars:
            continue
        group = [
            other
            for other, other_text in normalised.items()
            if common_prefix_length(text, other_text) >= min_chars
        ]
        if len(group) >= 2 and len(group) > len(best):
            best = group
    return best


def agreement_share(
    mine: str, finished: bool, others: Sequence[tuple[str, bool]], prefix_chars: int
) -> float:
    """Share of ``others`` (each ``(text, finished)``) whose text agrees with ``mine`` so far:
    two finished texts agree when their normalised answers are equal; otherwise when they share
    ``prefix_chars`` leading characters (or all of the shorter one). An empty text agrees with
    nothing and is not held against the others' share."""
    if not others or not mine.strip():
        return 0.0
    normalised = normalize_answer(mine)
    agree = 0
    for text, other_finished in others:
        theirs = normalize_answer(text)
        if not theirs:
            continue
        need = min(prefix_chars, len(normalised), len(theirs))
        if finished and other_finished:
            agree += normalised == theirs
        elif common_prefix_length(normalised, theirs) >= need:
            agree += 1
    return agree / len(others)


def mean_logprob(total: float, count: int) -> float | None:
    return total / count if count else None


def stream_score(
    *,
    logprob: float | None,
    passes_gates: bool,
    refusal: bool,
    win_rate: float,
    support: float,
    finished: bool,
) -> float:
    """Higher is better. Length-normalised log-probability (0 when unknown), plus the share of
    other workers that agree with this one, plus the model's past win rate; gate failures and
    refusals sink a stream below any passing one."""
    score = (logprob if logprob is not None else 0.0) + support + 0.5 * win_rate
    if finished:
        score += 0.1
    if refusal:
        score -= 5.0
    if not passes_gates:
        score -= 10.0
    return score


@dataclass
class WinRecord:
    """How often each model's stream was chosen when it took part (Laplace-smoothed)."""

    wins: dict[str, int] = field(default_factory=dict)
    rounds: dict[str, int] = field(default_factory=dict)

    def record(self, participants: Sequence[str], winner: str | None) -> None:
        for model in set(participants):
            self.rounds[model] = self.rounds.get(model, 0) + 1
        if winner is not None:
            self.wins[winner] = self.wins.get(winner, 0) + 1

    def rate(self, model: str) -> float:
        return (self.wins.get(model, 0) + 1) / (self.rounds.get(model, 0) + 2)
