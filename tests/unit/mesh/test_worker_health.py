"""The worker health check's state machine (pure: outcomes and ``now`` in, a verdict out)."""

from __future__ import annotations

import logging

from mesh.worker_health import Health, HealthCheck, HealthOptions

OPTIONS = HealthOptions(interval_s=2.0, misses=3, stall_s=60.0)
WELL = {"status": "ok", "engine_busy_s": 0.01}


def test_a_worker_that_answers_stays_healthy() -> None:
    check = HealthCheck("m", OPTIONS, now=0.0)
    for t in range(1, 50):
        assert check.answered(t * 2.0, WELL) is Health.HEALTHY
    assert check.status(100.0) == {"state": "healthy", "missed": 0, "last_answer_s": 2.0}


def test_misses_in_a_row_make_it_stuck_after_the_stated_number() -> None:
    check = HealthCheck("m", OPTIONS, now=0.0)
    assert check.no_answer(2.0) is Health.MISSING
    assert check.no_answer(4.0) is Health.MISSING
    assert check.no_answer(6.0) is Health.STUCK
    assert check.why == "no answer to its health check for 6.0 s"


def test_one_answer_in_time_resets_the_count() -> None:
    check = HealthCheck("m", OPTIONS, now=0.0)
    check.no_answer(2.0)
    check.no_answer(4.0)
    assert check.answered(6.0, WELL) is Health.HEALTHY
    assert check.no_answer(8.0) is Health.MISSING
    assert check.no_answer(10.0) is Health.MISSING
    assert check.missed == 2


def test_an_engine_in_one_step_too_long_counts_as_a_miss_though_it_answers() -> None:
    check = HealthCheck("m", OPTIONS, now=0.0)
    busy = {"status": "ok", "engine_busy_s": 61.0}
    assert check.answered(2.0, busy) is Health.MISSING
    assert check.answered(4.0, busy) is Health.MISSING
    assert check.answered(6.0, busy) is Health.STUCK
    assert "in one step for 61 s" in check.why


def test_a_long_prefill_step_under_the_stall_limit_is_healthy() -> None:
    check = HealthCheck("m", OPTIONS, now=0.0)
    assert check.answered(2.0, {"engine_busy_s": 59.0}) is Health.HEALTHY
    assert check.answered(4.0, {}) is Health.HEALTHY  # an older worker says nothing of it


def test_stuck_is_final() -> None:
    check = HealthCheck("m", HealthOptions(misses=1), now=0.0)
    assert check.no_answer(2.0) is Health.STUCK
    assert check.answered(4.0, WELL) is Health.STUCK  # it is being replaced
    assert check.no_answer(6.0) is Health.STUCK and check.missed == 1


def test_each_change_is_logged_old_to_new() -> None:
    # A handler of its own: the root's may carry the node's repeat filter (another test's CLI run).
    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    logger = logging.getLogger("mesh.worker_health")
    lines, level = Lines(), logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        check = HealthCheck("m", HealthOptions(misses=2), now=0.0)
        check.no_answer(2.0)
        check.answered(3.0, WELL)
        check.answered(4.0, WELL)  # no change: no line
        check.no_answer(5.0)
        check.no_answer(6.0)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    assert [line.split(" (")[0] for line in lines.lines] == [
        "worker m: healthy -> missing",
        "worker m: missing -> healthy",
        "worker m: healthy -> missing",
        "worker m: missing -> stuck",
    ]
