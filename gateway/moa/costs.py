"""What a ``mesh`` decision cost and found, as ``x-moa-*`` headers (the Responses API copies them
into the response's ``metadata``; ``/metrics`` counts them).

- ``x-moa-policy``: the policy run; ``x-moa-auto``: the rule that chose it, when ``auto`` did;
- ``x-moa-workers``: candidates started; ``x-moa-stopped``: of those, stopped by the decision;
- ``x-moa-votes``: votes per answer, most first (``vote``), ``answer=count`` pairs joined by
  ``, `` with each answer percent-encoded and cut to :data:`ANSWER_CHARS`; at most
  :data:`MAX_ANSWERS` answers; ``x-moa-abstained``: finished candidates without an answer;
- ``x-moa-options``: the distinct complete candidates the judge model was shown (``judge``);
- ``x-moa-winner``, ``x-moa-decision`` (the rule that decided), ``x-moa-decision-ms``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote, unquote

if TYPE_CHECKING:
    from gateway.moa.arbiter import Arbiter

ANSWER_CHARS = 40
MAX_ANSWERS = 8


def format_votes(votes: dict[str, int]) -> str:
    return ", ".join(
        f"{quote(answer[:ANSWER_CHARS], safe=' ')}={count}"
        for answer, count in list(votes.items())[:MAX_ANSWERS]
    )


def parse_votes(header: str) -> dict[str, int]:
    """The inverse of :func:`format_votes` (answers as cut)."""
    out: dict[str, int] = {}
    for pair in filter(None, header.split(", ")):
        answer, _, count = pair.rpartition("=")
        out[unquote(answer)] = int(count)
    return out


def decision_headers(arbiter: Arbiter, winner: str, decided_s: float) -> dict[str, str]:
    headers = {
        "x-moa-winner": winner,
        "x-moa-decision": arbiter.reason or "",
        "x-moa-decision-ms": f"{decided_s * 1000:.0f}",
        "x-moa-stopped": str(arbiter.stopped_early),
    }
    if arbiter.policy == "vote":
        headers["x-moa-votes"] = format_votes(arbiter.tally.votes())
        headers["x-moa-abstained"] = str(len(arbiter.tally.abstained))
    if arbiter.policy == "judge":
        headers["x-moa-options"] = str(len(arbiter.judge_options))
    return headers
