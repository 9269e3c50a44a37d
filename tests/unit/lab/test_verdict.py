"""The verdict must be able to fail: broken synthetic runs are fed to it and must not pass.

Every broken run below keeps fault-phase success at the floor (half the requests ok), so each
fails on its own rule, not on the floor by accident.
"""

from __future__ import annotations

import pytest

from lab.rows import ProbeRow
from lab.scenario import parse_scenario
from lab.verdict import Verdict, judge

START = 1000.0
# A kill at 5 s and a restart at 15 s: the fault phase is [5, 15).
SCENARIO = parse_scenario(
    """
name = "broken-runs"
duration_s = 25
[[nodes]]
[[nodes]]
[[steps]]
at = 5
action = "kill"
node = 1
[[steps]]
at = 15
action = "restart"
node = 1
[expect]
min_success = 0.5
max_time_to_error_s = 5
recover_within_s = 5
"""
)


def _row(at: float, kind: str = "stream", outcome: str = "ok", **kw) -> ProbeRow:
    fields = dict(text="one two three", duration_s=0.1, status=200)
    if outcome != "ok":
        fields = dict(text=None, duration_s=0.05, status=None)
    return ProbeRow(
        t=START + at,
        url="u",
        kind=kind,
        model="tiny-1",
        api="chat",
        outcome=outcome,
        **(fields | kw),
    )


def _run(fault_failure: dict | None = None, *, every_fault_row: bool = False) -> Verdict:
    """Ok before and after; in the fault phase each non-stream request succeeds and each
    stream fails like ``fault_failure`` (default: the proper SSE error event a kill gives,
    3.6 s in). ``every_fault_row``: the non-stream ones fail the same way too."""
    failure = fault_failure or dict(outcome="error_event", duration_s=3.6, error="peer lost")
    rows = [_row(at, kind) for at in (1.0, 2.0, 3.0) for kind in ("sentinel", "stream")]
    for at in range(5, 15):
        rows.append(_row(at, "sentinel", **failure) if every_fault_row else _row(at, "sentinel"))
        rows.append(_row(at + 0.5, "stream", **failure))
    rows += [_row(at, kind) for at in (16.0, 17.0) for kind in ("sentinel", "stream")]
    return judge(SCENARIO, rows, started_at=START)


def _fails_because(verdict: Verdict, *words: str) -> None:
    assert not verdict.passed
    assert any(all(w in reason for w in words) for reason in verdict.reasons), verdict.reasons


def test_a_healthy_run_with_proper_errors_passes() -> None:
    verdict = _run()
    assert verdict.passed, verdict.reasons
    assert (verdict.fault_requests, verdict.fault_ok, verdict.failed_proper) == (20, 10, 10)
    assert verdict.failed_improper == 0 and verdict.improper == {}
    assert verdict.slowest_error_s == pytest.approx(3.6)


def test_a_503_that_says_when_to_come_back_is_proper() -> None:
    verdict = _run(dict(outcome="http_error", status=503, retry_after="1"))
    assert verdict.passed, verdict.reasons
    assert verdict.failed_proper == 10
    assert _run(dict(outcome="http_error", status=404)).passed


def test_every_fault_phase_stream_truncated_fails() -> None:
    verdict = _run(dict(outcome="truncated", status=200, error="body ended early"))
    _fails_because(verdict, "10 improper failures", "10 truncated")
    assert verdict.failed_improper == 10 and verdict.failed_proper == 0


def test_every_answer_http_500_fails() -> None:
    verdict = _run(dict(outcome="http_error", status=500), every_fault_row=True)
    _fails_because(verdict, "20 improper failures", "HTTP 500")
    _fails_because(verdict, "fault-phase success 0%", "floor 50%")


@pytest.mark.parametrize(
    ("status", "retry_after", "cause"),
    [
        (502, None, "HTTP 502"),  # our own gateway's "upstream failed": a bug, not a refusal
        (504, None, "HTTP 504"),  # a timeout with a status line is still a timeout
        (503, None, "HTTP 503 without Retry-After"),
        (500, "1", "HTTP 500"),  # Retry-After does not make a 500 proper
    ],
)
def test_other_5xx_are_improper(status: int, retry_after: str | None, cause: str) -> None:
    verdict = _run(dict(outcome="http_error", status=status, retry_after=retry_after))
    _fails_because(verdict, "improper failures", cause)


def test_every_error_after_28_s_fails() -> None:
    verdict = _run(dict(outcome="error_event", duration_s=28.0, error="peer lost"))
    assert verdict.failed_improper == 0  # proper errors, but far too late
    _fails_because(verdict, "10 errors took longer than 5s", "slowest 28.0s")


def test_refused_connections_fail() -> None:
    refused = dict(outcome="transport_error", error="ConnectError: [Errno 111] refused")
    _fails_because(_run(refused), "10 improper failures", "transport error", "refused")


def test_timeouts_fail() -> None:
    timeout = dict(outcome="timeout", duration_s=30.0, error="no response head within 30s")
    verdict = _run(timeout)
    _fails_because(verdict, "improper failures", "10 timed out")
    _fails_because(verdict, "took longer than 5s", "slowest 30.0s")


def test_hung_streams_fail_and_are_not_counted_twice() -> None:
    verdict = _run(dict(outcome="hung", status=200, duration_s=30.0))
    _fails_because(verdict, "10 hung requests")
    assert verdict.improper == {} and verdict.failed_improper == 0


def test_success_below_the_floor_fails_even_when_every_error_is_proper() -> None:
    verdict = _run(every_fault_row=True)
    assert verdict.failed_improper == 0
    _fails_because(verdict, "fault-phase success 0% (0/20) below the floor 50%")


def test_a_fault_phase_without_requests_fails() -> None:
    rows = [_row(1.0), _row(16.0)]
    _fails_because(judge(SCENARIO, rows, START), "no probe requests started in the fault phase")


def test_one_step_scenarios_judge_the_floor_from_the_step_to_the_end() -> None:
    scenario = parse_scenario(
        'name = "join"\nduration_s = 20\n[[nodes]]\n[[nodes]]\nstart = false\n'
        '[[steps]]\nat = 5\naction = "join"\nnode = 1\n[expect]\nmin_success = 0.9\n'
    )
    assert scenario.fault_phase == (5, float("inf"))
    rows = [_row(1.0), _row(6.0), _row(18.0, outcome="error_event")]
    verdict = judge(scenario, rows, START)
    assert (verdict.fault_requests, verdict.fault_ok) == (2, 1)
    _fails_because(verdict, "fault-phase success 50% (1/2) below the floor 90%")
