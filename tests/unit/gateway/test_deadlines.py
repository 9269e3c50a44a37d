"""A worker stream's first-token and idle deadlines: the pure rule (tests/unit/gateway/
test_worker_client.py has WorkerClient keeping it)."""

from __future__ import annotations

from gateway.deadlines import FIRST_TOKEN_S, IDLE_S, StreamDeadlines


def test_the_first_token_is_due_from_the_start_and_each_next_line_from_the_last() -> None:
    deadlines = StreamDeadlines(first_token_s=30.0, idle_s=5.0)
    assert deadlines.due(started=100.0, last_heard=None) == 130.0
    assert deadlines.due(started=100.0, last_heard=128.0) == 133.0  # heard: the gap counts


def test_no_deadline_is_none() -> None:
    assert StreamDeadlines(None, None).due(0.0, None) is None
    assert StreamDeadlines(None, None).due(0.0, 1.0) is None
    assert StreamDeadlines(None, 1.0).due(0.0, 2.0) == 3.0


def test_the_defaults_leave_room_for_a_cold_prefill_and_say_why_in_words() -> None:
    assert FIRST_TOKEN_S >= 300 and IDLE_S < FIRST_TOKEN_S
    deadlines = StreamDeadlines(first_token_s=600.0, idle_s=120.0)
    assert deadlines.missed(heard=False) == "the worker sent no first token within 600 s"
    assert deadlines.missed(heard=True) == "the worker sent nothing for 120 s mid-answer"
