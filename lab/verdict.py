"""Judging a scenario run from its probe rows: pure, so it is tested without any node running."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pydantic import BaseModel

from lab.rows import PROPER_FAILURES, Outcome, ProbeRow
from lab.scenario import Scenario
from lab.stats import percentile


class PhaseStats(BaseModel):
    """Probe numbers for one phase: before the first step, between first and last, after."""

    phase: str
    requests: int
    ok: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None


class Verdict(BaseModel):
    scenario: str
    sent: int
    succeeded: int
    failed_proper: int  # the server said no properly: an error event or an HTTP error
    failed_improper: int  # timeouts, truncated bodies, transport errors (not hung)
    hung: int  # must be 0
    identical: int | None  # ok fault-phase outputs equal to the no-fault baseline's
    compared: int | None  # ok fault-phase outputs that had a baseline to compare with
    recovery_s: float | None  # from the last step to the first ok after which all were ok
    recovered: bool
    passed: bool
    reasons: list[str]  # why it did not pass (empty when it did)
    phases: list[PhaseStats] = []

    @property
    def success_rate(self) -> float:
        return self.succeeded / self.sent if self.sent else 0.0


def _key(row: ProbeRow) -> tuple[str, str | None, str]:
    return (row.model, row.api, row.kind)


# "mesh" (mixture of agents) picks among differently sampled candidates: its text may change
# from one request to the next without any fault, so it is not compared.
UNCOMPARED_MODELS = frozenset({"mesh"})


def baseline_outputs(rows: Sequence[ProbeRow], until: float) -> dict[tuple, str]:
    """The most common ok output per model × api × kind among rows started before ``until``."""
    seen: dict[tuple, Counter[str]] = {}
    for row in rows:
        if row.model in UNCOMPARED_MODELS:
            continue
        if row.t < until and row.ok and row.text is not None:
            seen.setdefault(_key(row), Counter())[row.text] += 1
    return {key: counts.most_common(1)[0][0] for key, counts in seen.items()}


def recovery_time(rows: Sequence[ProbeRow], since: float) -> float | None:
    """Seconds from ``since`` to the start of the first ok row after which every row was ok."""
    after = sorted((row for row in rows if row.t >= since), key=lambda row: row.t)
    if not after or not after[-1].ok:
        return None
    index = len(after) - 1
    while index > 0 and after[index - 1].ok:
        index -= 1
    return after[index].t - since


def phase_stats(
    rows: Sequence[ProbeRow], bounds: Sequence[tuple[str, float, float]]
) -> list[PhaseStats]:
    """Per named ``[start, end)`` wall-time window: requests, ok, TTFT p50/p95 of ok streams."""
    out = []
    for name, start, end in bounds:
        inside = [row for row in rows if start <= row.t < end]
        ttfts = [r.ttft_s for r in inside if r.ok and r.kind == "stream" and r.ttft_s is not None]
        out.append(
            PhaseStats(
                phase=name,
                requests=len(inside),
                ok=sum(1 for row in inside if row.ok),
                ttft_p50_s=percentile(ttfts, 50),
                ttft_p95_s=percentile(ttfts, 95),
            )
        )
    return out


def judge(scenario: Scenario, rows: Sequence[ProbeRow], started_at: float) -> Verdict:
    """``started_at`` is the wall time of the probe's t=0 (what the steps' ``at`` count from)."""
    probes = [row for row in rows if row.kind != "models"]
    counts = Counter(row.outcome for row in probes)
    ok = counts[Outcome.OK]
    proper = sum(counts[o] for o in PROPER_FAILURES)
    hung = counts[Outcome.HUNG]

    identical = compared = None
    first_fault = scenario.first_fault_at
    if first_fault is not None:
        boundary = started_at + first_fault
        baseline = baseline_outputs(probes, boundary)
        if baseline:
            later = [r for r in probes if r.t >= boundary and r.ok and _key(r) in baseline]
            compared = len(later)
            identical = sum(1 for r in later if r.text == baseline[_key(r)])

    recovery_s = None
    recovered = True
    if scenario.recovery_from is not None:
        recovery_s = recovery_time(probes, started_at + scenario.recovery_from)
        recovered = recovery_s is not None

    expect = scenario.expect
    reasons = []
    if hung > expect.max_hung:
        reasons.append(f"{hung} hung requests (allowed {expect.max_hung})")
    rate = ok / len(probes) if probes else 0.0
    if not probes:
        reasons.append("no probe requests were sent")
    if expect.min_success_rate is not None and rate < expect.min_success_rate:
        reasons.append(f"success rate {rate:.1%} below {expect.min_success_rate:.0%}")
    if not recovered:
        reasons.append("did not recover: the last probes still failed")
    elif expect.recover_within_s is not None and (recovery_s or 0.0) > expect.recover_within_s:
        reasons.append(f"recovered after {recovery_s:.1f}s (allowed {expect.recover_within_s:g}s)")
    bounds = [("whole run", started_at, float("inf"))]
    if scenario.steps:
        first, last = started_at + scenario.steps[0].at, started_at + scenario.steps[-1].at
        bounds = [
            ("before faults", started_at, first),
            ("during", first, last),
            ("after", last, float("inf")),
        ]
        if first == last:  # one step (or all at once): nothing happens "during"
            del bounds[1]
    return Verdict(
        phases=phase_stats(probes, bounds),
        scenario=scenario.name,
        sent=len(probes),
        succeeded=ok,
        failed_proper=proper,
        failed_improper=len(probes) - ok - proper - hung,
        hung=hung,
        identical=identical,
        compared=compared,
        recovery_s=recovery_s,
        recovered=recovered,
        passed=not reasons,
        reasons=reasons,
    )
