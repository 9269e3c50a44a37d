"""Consensus among complete samples: the one most like the others (issue 43, item 5).

For open answers no final answer can be extracted to vote with. Universal self-consistency
(Chen et al. 2023) and medoid selection pick instead the sample that agrees most with the rest:
here each sample scores the word overlap (ROUGE-1 F1, on lower-cased words) it shares with every
other sample, each other sample weighted by its confidence (its geometric-mean token
probability, ``exp`` of the mean log-probability). A sample that loops or fails a gate weighs
nothing and cannot win; one cut off by ``max_tokens`` wins only when no complete one is there.
With two samples, overlap cannot tell them apart: the more confident one stands.

Pure: no I/O.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

from gateway.moa import gates
from gateway.moa.judge import confidence
from gateway.moa.views import WorkerView

_WORD = re.compile(r"\w+")


def words(text: str) -> Counter[str]:
    return Counter(_WORD.findall(text.lower()))


def overlap(a: Counter[str], b: Counter[str]) -> float:
    """ROUGE-1 F1 of two bags of words (0 when either is empty)."""
    shared = sum((a & b).values())
    if not shared:
        return 0.0
    precision, recall = shared / sum(a.values()), shared / sum(b.values())
    return 2 * precision * recall / (precision + recall)


def _weight(view: WorkerView, passes: bool) -> float:
    if not passes:
        return 0.0
    logprob = view.mean_logprob
    return 1.0 if logprob is None else math.exp(logprob)


def most_central(views: Sequence[WorkerView]) -> WorkerView | None:
    """The finished sample with text most like the others (confidence-weighted); None when
    no sample finished with text."""
    pool = [v for v in views if v.finished and v.text.strip()]
    if not pool:
        return None
    passes = {v.name: v.verdict() is gates.Verdict.PASS for v in pool}  # the gates, once each
    eligible = [v for v in pool if passes[v.name]]
    eligible = [v for v in eligible if v.finish_reason != "length"] or eligible or pool
    if len(pool) < 3:
        return max(eligible, key=confidence)
    bags = {v.name: words(v.text) for v in pool}
    weights = {v.name: _weight(v, passes[v.name]) for v in pool}

    def centrality(view: WorkerView) -> float:
        return sum(
            weights[other.name] * overlap(bags[view.name], bags[other.name])
            for other in pool
            if other is not view
        )

    return max(eligible, key=lambda v: (round(centrality(v), 9), confidence(v)))
