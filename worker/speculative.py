"""Prompt-lookup drafting (pure): guess a row's next tokens from its own prompt and answer.

An agent's answer is mostly text it has already seen (a file returned with one change, a diff, a
command echoed from the prompt). Prompt lookup (Saxena 2023; llama.cpp's ``lookup``) finds the
last few tokens earlier in the context and proposes the tokens that followed them there; the
engine checks the proposal in one forward pass (worker/engine_verify.py). A wrong guess costs
the verify pass a few more tokens, never a wrong answer.

:class:`NgramIndex` keeps, per n-gram length, where each n-gram last ended, updated as tokens
arrive (O(max_n) per token), so drafting never rescans a long prompt. :class:`RowPolicy` turns
drafting off for a row whose guesses keep failing (measured acceptance, not a guess).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MIN_NGRAM = 2  # shorter matches guess wrong too often to pay for their verify tokens
MAX_NGRAM = 4


class NgramIndex:
    """Where each n-gram (``min_n``..``max_n`` tokens) of a token sequence last ended.

    Every position but the newest is indexed, so the sequence's own suffix is found only where
    it occurred *before* (its continuation is then known)."""

    def __init__(self, min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self._index_last()
            self.tokens.append(int(token))

    def sync(self, tokens: Sequence[int]) -> None:
        """Catch up with ``tokens``, which extends what this index has seen."""
        if len(tokens) > len(self.tokens):
            self.extend(tokens[len(self.tokens) :])

    def _index_last(self) -> None:
        """Index the n-grams ending at the current last position (no longer the newest)."""
        tokens, end = self.tokens, len(self.tokens) - 1
        for n in range(self.min_n, min(self.max_n, end + 1) + 1):
            self._ends[n][tuple(tokens[end - n + 1 : end + 1])] = end

    def draft(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the longest earlier occurrence of the current
        suffix (its latest occurrence at that length); [] when there is none."""
        tokens = self.tokens
        if limit <= 0:
            return []
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            end = self._ends[n].get(tuple(tokens[-n:]))
            if end is not None:
                return _continue(tokens, end + 1, limit)
        return []


def _continue(tokens: list[int], start: int, limit: int) -> list[int]:
    """``limit`` tokens from ``start`` on; past the end they go on as the draft itself does
    (a repeat that reaches the present repeats again: a loop, a table's rows)."""
    draft = tokens[start : start + limit]
    while len(draft) < limit:
        draft.append(draft[start + len(draft) - len(tokens)])
    return draft


@dataclass
class RowPolicy:
    """Whether a row drafts, from its measured acceptance.

    A verify pass carries the drafted tokens through the model: on a bandwidth-bound decode
    they cost little, but a row whose guesses keep failing pays for them and gains nothing. After
    ``window`` drafted tokens with fewer than ``min_rate`` of them accepted, the row rests for
    ``rest_steps`` steps (the text may turn to copying later: an edit's unchanged tail)."""

    window: int = 24
    min_rate: float = 0.3
    rest_steps: int = 64
    drafted: int = 0
    accepted: int = 0
    resting: int = 0
    totals: list[int] = field(default_factory=lambda: [0, 0])  # drafted, accepted: ever

    def may_draft(self) -> bool:
        if self.resting > 0:
            self.resting -= 1
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.totals[0] += drafted
        self.totals[1] += accepted
        if self.drafted >= self.window:
            if self.accepted < self.min_rate * self.drafted:
                self.resting = self.rest_steps
            self.drafted = self.accepted = 0
