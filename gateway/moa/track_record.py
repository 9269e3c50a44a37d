"""Each model's measured track record in ``mesh``'s pools, and what the pool does with it
(issue 43, item 4): candidates ordered by measured quality rather than size, and a pool whose
best model is clearly better collapsed to that model alone.

SLM-MUX (2025): among small models, the one whose samples agree with the consensus is usually
the one that knows. So a node counts, per model, how often that model's ballots agreed with a
decided vote's answer, and how often its race openings passed the gates – only in pools of
two or more models (a model agreeing with its own samples says nothing) – and gossips its
counts (mesh: ``NodeState.track_record``). Every node sums its own and its peers' counts; each
node counts only the decisions it made, so nothing is counted twice.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

# A model's rate counts once it rests on this many observations; before that it has the prior.
MIN_EVIDENCE = 20
PRIOR = 0.5
# A model measured this far below the pool's best measured one leaves the pool (a pool whose
# best model is clearly better than every other collapses to it).
COLLAPSE_MARGIN = 0.25
# One source's word on a model counts as at most this many observations of each kind (a
# member gossiping huge counts outweighs no more than this), and a source names at most
# MAX_MODELS models.
MAX_PER_SOURCE = 1000
MAX_MODELS = 64


@dataclass(slots=True)
class Counts:
    """One model's observations: ballots in decided votes (and how many agreed with the
    decided answer), race openings (and how many passed the gates)."""

    agreed: int = 0
    ballots: int = 0
    passed: int = 0
    openings: int = 0

    def bounded(self) -> Counts:
        """The same rates on at most ``MAX_PER_SOURCE`` observations of each kind."""

        def scaled(hits: int, total: int) -> tuple[int, int]:
            total, hits = max(0, total), max(0, min(hits, total))
            if total <= MAX_PER_SOURCE:
                return hits, total
            return round(hits * MAX_PER_SOURCE / total), MAX_PER_SOURCE

        agreed, ballots = scaled(self.agreed, self.ballots)
        passed, openings = scaled(self.passed, self.openings)
        return Counts(agreed, ballots, passed, openings)

    def add(self, other: Counts) -> None:
        self.agreed += other.agreed
        self.ballots += other.ballots
        self.passed += other.passed
        self.openings += other.openings

    def quality(self) -> float | None:
        """Agreement with decided votes (Laplace-smoothed) once there are enough ballots, else
        the race's pass rate once there are enough openings, else None (not measured)."""
        if self.ballots >= MIN_EVIDENCE:
            return (self.agreed + 1) / (self.ballots + 2)
        if self.openings >= MIN_EVIDENCE:
            return (self.passed + 1) / (self.openings + 2)
        return None


class TrackRecord:
    """This node's counts per model (what it gossips), and the sum with the peers' counts."""

    def __init__(self) -> None:
        self.local: dict[str, Counts] = {}

    def _of(self, model: str) -> Counts:
        return self.local.setdefault(model, Counts())

    def record_vote(self, ballots: Sequence[tuple[str, str]], decided: str) -> None:
        """A decided vote's ballots as (model, answer): each agrees or not with ``decided``."""
        if len({model for model, _ in ballots}) < 2:
            return
        for model, answer in ballots:
            counts = self._of(model)
            counts.ballots += 1
            counts.agreed += answer == decided

    def record_openings(self, openings: Sequence[tuple[str, bool]]) -> None:
        """A race's openings as (model, passed the gates)."""
        if len({model for model, _ in openings}) < 2:
            return
        for model, passed in openings:
            counts = self._of(model)
            counts.openings += 1
            counts.passed += passed

    def as_dict(self) -> dict[str, dict[str, int]]:
        """This node's own counts, for gossip."""
        return {model: asdict(counts) for model, counts in self.local.items()}

    def merged(self, peers: Iterable[Mapping[str, Mapping[str, int]]] = ()) -> dict[str, Counts]:
        """This node's counts plus every peer's, per model."""
        total: dict[str, Counts] = {}
        for source in (self.as_dict(), *peers):
            for model, counts in list(source.items())[:MAX_MODELS]:
                fields = {k: int(counts.get(k, 0)) for k in ("agreed", "ballots", "passed", "openings")}  # fmt: skip
                total.setdefault(model, Counts()).add(Counts(**fields).bounded())
        return total


def measured(model: str, record: Mapping[str, Counts]) -> float | None:
    """A model's measured quality in ``record`` (:meth:`Counts.quality`); None: not yet."""
    counts = record.get(model)
    return counts.quality() if counts is not None else None


def quality_of(model: str, record: Mapping[str, Counts]) -> float:
    """A model's measured quality, or the prior when it is not measured yet."""
    quality = measured(model, record)
    return PRIOR if quality is None else quality


def collapsed(models: Sequence[str], record: Mapping[str, Counts]) -> list[str]:
    """``models`` (best first) without those measured ``COLLAPSE_MARGIN`` or more below the
    best measured one: a pool whose best model is clearly better than all the others is that
    model alone. Models not measured yet stay (they are how they get measured)."""
    known = {m: q for m in models if (q := measured(m, record)) is not None}
    if not known:
        return list(models)
    best = max(known.values())
    return [m for m in models if m not in known or best - known[m] < COLLAPSE_MARGIN]
