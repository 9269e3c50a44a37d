"""Prompt-lookup drafting (pure): guess a row's next tokens from its own prompt and answer.

An agent's answer is mostly text it has already seen (a file returned with one change, a diff, a
command echoed from the prompt). Prompt lookup (Saxena 2023; llama.cpp's ``lookup``) finds the
last few tokens earlier in the context and proposes the tokens that followed them there; the
engine checks the proposal in one forward pass (worker/speculative/batch.py). A wrong guess costs
the verify pass a few more tokens, never a wrong answer.

:class:`NgramIndex` keeps, per n-gram length, where each n-gram last ended, updated as tokens
arrive (O(max_n) per token), so drafting never rescans a long prompt. :class:`RowPolicy` turns
drafting off for a row whose guesses keep failing (measured acceptance, not a guess).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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


def lookup_ceiling(prompt: list[int], answer: list[int], width: int = 8) -> tuple[int, int]:
    """(answer tokens, verify passes) if every pass drafted ``width`` tokens by prompt lookup
    and kept the ones the answer has: what the answer itself allows, whatever the cost of a
    pass (a ceiling on tokens per pass; an answer that copies nothing gives 1)."""
    index = NgramIndex()
    index.extend(prompt)
    done = passes = 0
    while done < len(answer):
        draft = index.draft(width)
        kept = 0
        while (
            kept < len(draft) and done + kept < len(answer) and draft[kept] == answer[done + kept]
        ):
            kept += 1
        step = min(kept + 1, len(answer) - done)
        index.extend(answer[done : done + step])
        done, passes = done + step, passes + 1
    return len(answer), passes


@dataclass
class RowPolicy:
    """Whether a row drafts, from its measured acceptance.

    A verify pass carries the drafted tokens through the model: on a bandwidth-bound decode
    they cost little, but a row whose guesses keep failing pays for them and gains nothing. After
    ``window`` drafted tokens with fewer than ``min_rate`` of them accepted, the row rests for
    ``rest_steps`` steps, twice as long after each failing window in a row up to
    ``max_rest_steps`` (back to ``rest_steps`` after one that passes): the text may turn to
    copying again soon – an answer that stops copying its prompt and starts repeating itself,
    an edit's unchanged tail – and a fixed 64-step rest sat out a 96-token answer's whole
    repeating part (the Claude Code turn of bench/results/speculative.md)."""

    window: int = 24
    min_rate: float = 0.3
    rest_steps: int = 16
    max_rest_steps: int = 64
    _next_rest: int = 0  # the rest the next failing window gets (0: rest_steps)
    drafted: int = 0
    accepted: int = 0
    resting: int = 0
    totals: list[int] = field(default_factory=lambda: [0, 0])  # drafted, accepted: ever
    # How likely the next drafted token is accepted, for :func:`best_width`: Laplace's rule
    # over recent drafted tokens that stood and drafts cut short, decayed by ``memory`` a
    # drafted token checked (so accepted short drafts keep raising it: an estimate per draft
    # was capped by the draft's length, and one-token drafts stayed one token for ever). It
    # starts at ``prior``: a context match usually goes on (acceptance 0.7-0.99 on the greedy
    # copying workloads of bench/results/speculative.md).
    memory: float = 0.9
    prior: float = 0.7
    stood: float = 4 / 3  # (stood + 1) / (stood + cut + 2) = prior
    cut: float = 0.0
    # A resting row whose drafter guesses for free (prompt lookup) still guesses each step's
    # token, and the token that comes shows whether a draft would have stood: ``observe``
    # counts that in the rate like a one-token draft, and ``wake_hits`` guesses in a row that
    # stood end the rest (the text turned to copying again; a 16-step rest sat out an agent
    # edit's repeating stretch that verify passes of 8 would have taken: bench/results/
    # speculative.md). 0: no guesses.
    wake_hits: int = 2
    _hits: int = 0  # guesses in a row that stood during this rest

    @property
    def rate(self) -> float:
        return (self.stood + 1) / (self.stood + self.cut + 2)

    def may_draft(self) -> bool:
        if self.resting > 0:
            self.resting -= 1
            return False
        return True

    def skip(self, rest_steps: int = 8) -> None:
        """The row had a draft but checking it was expected to cost more than it gives: rest a
        few steps (asking costs the step its pipelining), and forget a little, so that a row
        whose drafts once failed gets to try again (its rate drifts back to the prior)."""
        self.stood *= self.memory
        self.cut *= self.memory
        self.resting = max(self.resting, rest_steps)
        self._hits = 0

    def observe(self, stood: bool) -> None:
        """A resting row's guess for the token that came was checked: it ``stood`` or not (in
        the rate as a one-token draft; not in the window, which decides rests)."""
        self._learn(int(stood), int(not stood))
        self._hits = self._hits + 1 if stood else 0
        if self._hits >= self.wake_hits:
            self.resting = self._hits = 0

    def miss(self, cost: int) -> None:
        """A step where the row's context matched but the draft came out empty: it counts
        against the row's window as ``cost`` refused tokens (what asking cost), not in its
        rate (no drafted token was refused)."""
        self._window(cost, 0)

    def record(self, drafted: int, accepted: int) -> None:
        # A draft is a run of trials that stops at the first refusal: ``accepted`` stood, and
        # one more was checked and refused unless all stood.
        refused = int(accepted < drafted)
        self._learn(accepted, refused)
        self._window(drafted, accepted)

    def _learn(self, accepted: int, refused: int) -> None:
        """Fold checked tokens into the rate, each decaying what came before."""
        decay = self.memory ** (accepted + refused)
        self.stood = decay * self.stood + accepted
        self.cut = decay * self.cut + refused

    def _window(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.totals[0] += drafted
        self.totals[1] += accepted
        if self.drafted >= self.window:
            if self.accepted < self.min_rate * self.drafted:
                self.resting = self._next_rest or self.rest_steps
                self._hits = 0
                self._next_rest = min(2 * self.resting, self.max_rest_steps)
            else:
                self._next_rest = 0
            self.drafted = self.accepted = 0


def expected_tokens(rate: float, drafted: int) -> float:
    """Tokens a verify pass is expected to give a row that drafted ``drafted`` tokens, each
    standing with chance ``rate`` while all before it stood: the sampled one, then 1 + rate +
    rate^2 + ... up to rate^drafted."""
    return sum(rate**j for j in range(drafted + 1))


def best_width(
    drafted: Sequence[int], rates: Sequence[float], slope: float, overhead: float = 0.0
) -> int:
    """The verify width (1 + drafted tokens a row; 1 is a plain step) that gives the batch the
    most tokens per unit of step time, a pass of width ``w`` costing ``1 + overhead + slope *
    (w - 1)`` plain steps (measured: :class:`StepCosts`). Rows are cut to the width; a row
    that drafted nothing gives its one token either way."""
    rows = len(drafted)
    best, most = 1, float(rows)  # a plain step: a token a row, for one step's time
    for width in range(2, max(drafted, default=0) + 2):
        cut = [min(d, width - 1) for d in drafted]
        tokens = sum(expected_tokens(r, d) for d, r in zip(cut, rates, strict=True))
        per_step = tokens / (1 + overhead + slope * (width - 1))
        if per_step > most:
            best, most = width, per_step
    return best


@dataclass
class StepCosts:
    """Measured seconds of the batch's steps: plain decode steps by batch rows, and what a
    verify pass costs beyond one, as shares of a plain step, by rows: an ``overhead`` any pass
    pays (the sync that costs the step its pipelining, the drafting, the rows that trim apart
    rolling their caches) and a ``slope`` each drafted position adds.

    A verify pass of a few tokens costs about one step where decode is bandwidth-bound and
    more as rows and vocabulary grow (bench/results/speculative.md). One slope alone charged
    the overhead to the drafted positions of narrow passes – 2-token passes of 4 rows measured
    0.5-1.2 a position, which then kept every pass narrow or declined – so the two are fitted
    apart from the last ``samples`` passes of each batch size, robustly (Theil-Sen: a pass that
    shared its time with a prefill chunk is an outlier, not the rule)."""

    prior_slope: float = 0.15  # SmolLM2-135M on this CPU box, 1-4 rows (the bench's table)
    prior_overhead: float = 0.0
    fixed: float | None = None  # a slope to use instead of measuring (and no overhead)
    samples: int = 9
    trusted: int = 3
    plain_s: dict[int, list[float]] = field(default_factory=dict)
    # Per batch size: (drafted positions, pass time / plain step - 1) of recent passes.
    passes: dict[int, list[tuple[int, float]]] = field(default_factory=dict)

    def plain(self, rows: int, seconds: float) -> None:
        self._add(self.plain_s, rows, seconds)

    def verify(self, rows: int, width: int, seconds: float) -> None:
        plain = self._median(self.plain_s, rows)
        if plain is not None and width > 1:
            self._add(self.passes, rows, (width - 1, seconds / plain - 1))

    def needs_plain(self, rows: int) -> bool:
        """Whether plain steps at this many rows are still to be timed (a verify pass's cost
        is measured against them; a batch that drafts every step would never time one)."""
        return self.fixed is None and len(self.plain_s.get(rows, ())) < self.trusted

    def model(self, rows: int) -> tuple[float, float]:
        """(overhead, slope) at this many rows: the priors until ``trusted`` passes were timed
        (one pass that ran beside something else would otherwise decide alone), then the
        median of the pairwise slopes between passes of different widths and the median
        overhead that leaves, once two widths were timed twice each. Until then the passes
        cannot tell the two apart: the slope is the prior's (or less, when even that is more
        than the passes cost)."""
        if self.fixed is not None:
            return 0.0, max(0.0, self.fixed)
        passes = self.passes.get(rows, [])
        if len(passes) < self.trusted:
            return self.prior_overhead, self.prior_slope
        widths = Counter(x for x, _ in passes)
        # Pairs only once two widths were each timed twice: a lone pass of another width
        # would be in every pair and set the slope alone.
        if sum(1 for n in widths.values() if n >= 2) >= 2:
            pairs = [
                (y2 - y1) / (x2 - x1)
                for i, (x1, y1) in enumerate(passes)
                for x2, y2 in passes[i + 1 :]
                if x2 != x1
            ]
            slope = max(0.0, _median_of(pairs))
        else:
            drafted = _median_of([x for x, _ in passes])
            excess = _median_of([y for _, y in passes])
            slope = min(self.prior_slope, max(0.0, excess) / drafted)
        overhead = max(0.0, _median_of([y - slope * x for x, y in passes]))
        return overhead, slope

    def _add(self, table: dict[int, list[Any]], rows: int, value: Any) -> None:
        values = table.setdefault(rows, [])
        values.append(value)
        del values[: -self.samples]

    @staticmethod
    def _median(table: dict[int, list[float]], rows: int) -> float | None:
        values = table.get(rows)
        return _median_of(values) if values else None


def _median_of(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


@dataclass(frozen=True, slots=True)
class Speculation:
    """How the batch speculates: ``mode`` "auto" (rows draft while their drafts pay) or "off"
    (a token a step), ``draft_tokens`` at most a row and step, ``max_rows`` the
    largest batch that still drafts (beyond it decode is no longer bandwidth-bound),
    ``wake_hits`` free guesses in a row that stand to end a row's rest (``RowPolicy``; 0:
    resting rows guess nothing and sit their rest out)."""

    mode: str = "auto"
    draft_tokens: int = 8
    max_rows: int = 4
    # What a drafted position adds to a verify pass, as a share of a plain step: None measures
    # it as the batch runs (StepCosts); a number fixes it (tests).
    slope: float | None = None
    wake_hits: int = RowPolicy.wake_hits

    @property
    def on(self) -> bool:
        return self.mode != "off"
