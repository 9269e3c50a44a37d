"""The ``vote`` policy's pure core: count candidates' final answers, say when the vote is decided.

Self-consistency (Wang et al. 2022) with adaptive stopping (Aggarwal et al. 2023): each
finished candidate casts its extracted answer (:func:`gateway.moa.answers.extract_answer`), or
abstains when it has none; a failed one withdraws. The vote is decided as soon as

- ``safe``: the leading answer cannot be caught by the candidates still running (it leads the
  runner-up by more than their number, so not even a tie is possible), or
- ``confident``: the Beta stopping rule says the leader's share beats the runner-up's with at
  least ``confidence`` (posterior Beta(v1 + 1, v2 + 1) over the leader's share of the two), or
- ``scattered``: at least half of the candidates are in and no answer has more than ``scatter``
  of them (abstentions count as in): the samples disagree too much for the rest to find a
  majority worth having, so the leader (on a tie the caller's own answer) stands, or
- ``complete``: nobody is left to vote.

The winner is the leading answer's candidate with the highest mean token log-probability,
complete ones before those cut off by ``max_tokens`` (ties: the one that voted first; ballots
are cast in lockstep order, :func:`read_ballots`, so a seeded request is reproducible). A cut-off
candidate votes with the answer its text so far gives (what a reader of that text would take
as its answer): on the screening items of ``bench/moa_quality.py`` its vote is worth more than
its abstention. Tied answers go to the caller's own (``preferred``) answer, else to the answer
whose voters have the higher mean log-probability.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.moa.answers import extract_answer, states_false_equation
from gateway.moa.views import WorkerView

CONFIDENCE = 0.95


@dataclass(frozen=True, slots=True)
class Ballot:
    candidate: str
    answer: str
    mean_logprob: float | None
    order: int  # when it was cast, for ties
    complete: bool = True  # False: cut off by max_tokens

    @property
    def confidence(self) -> float:
        return self.mean_logprob if self.mean_logprob is not None else -math.inf


def beta_leads(leader: int, runner_up: int) -> float:
    """P(p_leader > p_runner_up) under a uniform prior after these counts: P(X > 1/2) for
    X ~ Beta(leader + 1, runner_up + 1), exactly (a binomial tail; integer counts)."""
    a, b = leader + 1, runner_up + 1
    n = a + b - 1
    # For integer a, b: P(X <= 1/2) = P(Binomial(n, 1/2) >= a).
    return sum(math.comb(n, k) for k in range(a)) / 2**n


class Tally:
    """The ballots of one request's candidates, and whether they settle the vote."""

    def __init__(
        self,
        candidates: Iterable[str],
        *,
        confidence: float = CONFIDENCE,
        preferred: str | None = None,
        scatter: float | None = None,
        weighted: float | None = None,
    ) -> None:
        self.pending: set[str] = set(candidates)
        self.preferred = preferred
        self.total = len(self.pending)
        self.confidence = confidence
        self.scatter = scatter
        self.weighted = weighted  # CISC's softmax temperature; None: one ballot, one vote
        self.ballots: list[Ballot] = []
        self.abstained: list[str] = []
        self.withdrawn: list[str] = []

    # -- inputs -----------------------------------------------------------------------------

    def cast(
        self, candidate: str, answer: str | None, mean_logprob: float | None, complete: bool = True
    ) -> None:
        """A finished candidate's answer (None: no extractable answer, it abstains);
        ``complete`` False: it was cut off by ``max_tokens``."""
        if candidate not in self.pending:
            return
        self.pending.discard(candidate)
        if answer is None:
            self.abstained.append(candidate)
        else:
            ballot = Ballot(candidate, answer, mean_logprob, len(self.ballots), complete)
            self.ballots.append(ballot)

    def withdraw(self, candidate: str) -> None:
        """A candidate that failed or was stopped: it will never vote."""
        if candidate in self.pending:
            self.pending.discard(candidate)
            self.withdrawn.append(candidate)

    # -- reading ----------------------------------------------------------------------------

    @property
    def remaining(self) -> int:
        return len(self.pending)

    def votes(self) -> dict[str, int]:
        """Votes per answer, most first (ties: the answer voted first)."""
        counts: dict[str, int] = {}
        for ballot in self.ballots:
            counts[ballot.answer] = counts.get(ballot.answer, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    def decision(self) -> str | None:
        """``safe``, ``confident``, ``scattered`` or ``complete`` once the vote is decided, else
        None."""
        counts = list(self.votes().values())
        leader = counts[0] if counts else 0
        runner_up = counts[1] if len(counts) > 1 else 0
        if self.remaining == 0:
            return "complete"
        if self.weighted is not None:
            return None  # a confident late ballot can outweigh any count
        if leader > runner_up + self.remaining:
            return "safe"
        if leader and beta_leads(leader, runner_up) >= self.confidence:
            return "confident"
        if self._scattered(leader):
            return "scattered"
        return None

    def _scattered(self, leader: int) -> bool:
        cast = len(self.ballots) + len(self.abstained)
        if self.scatter is None or 2 * cast < self.total or len(self.votes()) < 2:
            return False  # disagreement needs two answers (abstentions alone say nothing)
        return leader <= self.scatter * cast

    def needed(self) -> int:
        """The fewest further votes that could decide the vote (all of them going to the
        leader): how many more samples are worth starting now; ``remaining`` when none can."""
        counts = list(self.votes().values())
        leader = counts[0] if counts else 0
        runner_up = counts[1] if len(counts) > 1 else 0
        if self.weighted is not None:
            return self.remaining
        for k in range(1, self.remaining + 1):
            left = self.remaining - k
            if (
                leader + k > runner_up + left
                or beta_leads(leader + k, runner_up) >= self.confidence
            ):
                return k
        return self.remaining

    def winner(self) -> Ballot | None:
        """The leading answer's most confident ballot; None when nobody voted."""
        if not self.ballots:
            return None
        clusters: dict[str, list[Ballot]] = {}
        for ballot in self.ballots:
            clusters.setdefault(ballot.answer, []).append(ballot)

        weights = self._weights()

        def strength(cluster: list[Ballot]) -> tuple[float, bool, float, int]:
            known = [b.mean_logprob for b in cluster if b.mean_logprob is not None]
            mean = sum(known) / len(known) if known else -math.inf
            preferred = any(b.candidate == self.preferred for b in cluster)
            votes = sum(weights[b.order] for b in cluster)
            return (round(votes, 9), preferred, mean, -cluster[0].order)

        best = max(clusters.values(), key=strength)
        return max(best, key=lambda b: (b.complete, b.confidence, -b.order))

    def _weights(self) -> list[float]:
        """Each ballot's weight, by order: 1, or (CISC) its softmax share of confidence."""
        if self.weighted is None:
            return [1.0] * len(self.ballots)
        known = [b.confidence for b in self.ballots if b.mean_logprob is not None]
        if not known:
            return [1.0] * len(self.ballots)
        top = max(known)
        return [
            math.exp((b.confidence - top) / self.weighted) if b.mean_logprob is not None else 0.0
            for b in self.ballots
        ]


def read_ballots(tally: Tally, views: Iterable[WorkerView], question: str | None = None) -> None:
    """Count the candidates that finished or died since the last look (each text is read once).

    A finished candidate votes with its extracted answer (``question``: the words it merely
    repeats from the question do not count, :func:`~gateway.moa.answers.extract_answer`); one
    that called a tool or states a false equation refutes itself and abstains; one cut off by
    ``max_tokens`` votes with what its text gives, as an incomplete ballot; a failed or
    cancelled one withdraws.

    Ballots are cast in the order a lockstep batch would finish them – fewest tokens first, then
    candidate order – never in the order their ends happened to arrive, and reading stops as
    soon as the vote is decided: a finished candidate is counted only once no streaming one can
    still come before it (it has streamed fewer tokens, or as many from an earlier place). So
    samples that decode together give the same decision and winner however their streams
    interleave (a seeded request gives the same answer twice). A candidate that has not
    streamed yet (a later prefill, a slow or stalled node) holds nobody up: it is not in step."""
    views = list(views)
    for view in views:
        if view.name in tally.pending and not view.alive:
            tally.withdraw(view.name)
    place = {view.name: i for i, view in enumerate(views)}
    streaming = [
        (v.tokens, place[v.name])
        for v in views
        if v.running and v.tokens and v.name in tally.pending
    ]
    finished = sorted(
        (v for v in views if v.finished and v.name in tally.pending),
        key=lambda v: (v.tokens, place[v.name]),
    )
    for view in finished:
        if any(other < (view.tokens, place[view.name]) for other in streaming):
            return  # a streaming candidate may still finish before this one
        refuted = view.tool_calls or states_false_equation(view.text)
        answer = None if refuted else extract_answer(view.text, question)
        tally.cast(view.name, answer, view.mean_logprob, view.finish_reason != "length")
        if tally.decision() is not None:
            return
