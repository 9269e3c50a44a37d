"""Judging a scenario run from its probe rows: pure, so it is tested without any node running."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pydantic import BaseModel

from lab.rows import Outcome, ProbeRow
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
    failed_proper: int  # the server said no properly: an error event, a 4xx, a 503 + Retry-After
    failed_improper: int  # timeouts, cut-off bodies, refused connections, other 5xx (not hung)
    hung: int  # must be 0
    improper: dict[str, int] = {}  # improper failures by cause ("truncated", "HTTP 500", ...)
    fault_requests: int | None = None  # requests started in the fault phase
    fault_ok: int | None = None
    min_success: float | None = None  # the floor fault_ok / fault_requests was held to
    slowest_error_s: float | None = None  # the longest any failed request took to end
    max_time_to_error_s: float | None = None
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


def failure_cause(row: ProbeRow) -> str:
    """A short name for why ``row`` failed: its HTTP status, or its outcome."""
    if row.outcome is Outcome.HTTP_ERROR:
        bare = row.status == 503 and row.retry_after is None
        return f"HTTP {row.status}" + (" without Retry-After" if bare else "")
    return _CAUSES.get(row.outcome, row.outcome.value)


_CAUSES = {
    Outcome.TIMEOUT: "timed out",
    Outcome.TRUNCATED: "truncated",
    Outcome.TRANSPORT_ERROR: "transport error (refused, reset or malformed)",
    Outcome.ERROR_EVENT: "error event",
}


def improper_causes(rows: Sequence[ProbeRow]) -> dict[str, int]:
    """Improper failures (hung ones are counted apart) by cause, most frequent first."""
    causes = Counter(
        failure_cause(row)
        for row in rows
        if row.failed_improperly and row.outcome is not Outcome.HUNG
    )
    return dict(causes.most_common())


def _expectation_reasons(
    scenario: Scenario, probes: Sequence[ProbeRow], verdict: Verdict
) -> list[str]:
    expect = scenario.expect
    reasons = []
    if not probes:
        reasons.append("no probe requests were sent")
    if verdict.hung > expect.max_hung:
        reasons.append(f"{verdict.hung} hung requests (allowed {expect.max_hung})")
    if verdict.improper:
        causes = ", ".join(f"{n} {cause}" for cause, n in verdict.improper.items())
        reasons.append(f"{sum(verdict.improper.values())} improper failures: {causes}")
    slow = [r.duration_s for r in probes if not r.ok and r.duration_s > expect.max_time_to_error_s]
    if slow:
        reasons.append(
            f"{len(slow)} errors took longer than {expect.max_time_to_error_s:g}s "
            f"(slowest {max(slow):.1f}s)"
        )
    if verdict.fault_requests == 0:
        reasons.append("no probe requests started in the fault phase")
    elif verdict.fault_requests and verdict.min_success is not None:
        rate = (verdict.fault_ok or 0) / verdict.fault_requests
        if rate < verdict.min_success:
            reasons.append(
                f"fault-phase success {rate:.0%} ({verdict.fault_ok}/{verdict.fault_requests}) "
                f"below the floor {verdict.min_success:.0%}"
            )
    if not verdict.recovered:
        reasons.append("did not recover: the last probes still failed")
    elif (
        expect.recover_within_s is not None
        and (verdict.recovery_s or 0.0) > expect.recover_within_s
    ):
        reasons.append(
            f"recovered after {verdict.recovery_s:.1f}s (allowed {expect.recover_within_s:g}s)"
        )
    return reasons


def _phase_bounds(scenario: Scenario, started_at: float) -> list[tuple[str, float, float]]:
    if not scenario.steps:
        return [("whole run", started_at, float("inf"))]
    first, last = started_at + scenario.steps[0].at, started_at + scenario.steps[-1].at
    bounds = [
        ("before faults", started_at, first),
        ("during", first, last),
        ("after", last, float("inf")),
    ]
    if first == last:  # one step (or all at once): nothing happens "during"
        del bounds[1]
    return bounds


def _compare_with_baseline(
    scenario: Scenario, probes: Sequence[ProbeRow], started_at: float
) -> tuple[int | None, int | None]:
    """(identical, compared) for ok fault-phase outputs against the no-fault baseline."""
    if scenario.first_fault_at is None:
        return None, None
    boundary = started_at + scenario.first_fault_at
    baseline = baseline_outputs(probes, boundary)
    if not baseline:
        return None, None
    later = [r for r in probes if r.t >= boundary and r.ok and _key(r) in baseline]
    return sum(1 for r in later if r.text == baseline[_key(r)]), len(later)


def judge(scenario: Scenario, rows: Sequence[ProbeRow], started_at: float) -> Verdict:
    """``started_at`` is the wall time of the probe's t=0 (what the steps' ``at`` count from)."""
    probes = [row for row in rows if row.kind != "models"]
    ok = sum(1 for row in probes if row.ok)
    proper = sum(1 for row in probes if row.failed_properly)
    hung = sum(1 for row in probes if row.outcome is Outcome.HUNG)
    identical, compared = _compare_with_baseline(scenario, probes, started_at)

    fault_requests = fault_ok = None
    if scenario.fault_phase is not None:
        start, end = (started_at + at for at in scenario.fault_phase)
        during = [row for row in probes if start <= row.t < end]
        fault_requests, fault_ok = len(during), sum(1 for row in during if row.ok)

    recovery_s = None
    recovered = True
    if scenario.recovery_from is not None:
        recovery_s = recovery_time(probes, started_at + scenario.recovery_from)
        recovered = recovery_s is not None

    errors = [row.duration_s for row in probes if not row.ok]
    verdict = Verdict(
        phases=phase_stats(probes, _phase_bounds(scenario, started_at)),
        scenario=scenario.name,
        sent=len(probes),
        succeeded=ok,
        failed_proper=proper,
        failed_improper=len(probes) - ok - proper - hung,
        hung=hung,
        improper=improper_causes(probes),
        fault_requests=fault_requests,
        fault_ok=fault_ok,
        min_success=scenario.expect.min_success,
        slowest_error_s=max(errors) if errors else None,
        max_time_to_error_s=scenario.expect.max_time_to_error_s,
        identical=identical,
        compared=compared,
        recovery_s=recovery_s,
        recovered=recovered,
        passed=True,
        reasons=[],
    )
    reasons = _expectation_reasons(scenario, probes, verdict)
    return verdict.model_copy(update={"passed": not reasons, "reasons": reasons})
