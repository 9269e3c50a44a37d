"""The commit point as a pure object: retryable until the first content event, never after."""

from __future__ import annotations

import pytest

from gateway.events import (
    Done,
    Error,
    Meta,
    Progress,
    ReasoningDelta,
    Sampling,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from gateway.router import CommitTracker

BUSY = Error(kind="overloaded", message="busy")
BROKEN = Error(kind="upstream", message="broke", retryable=True)
REFUSED = Error(kind="invalid_request", message="bad")


@pytest.mark.parametrize(
    "fact",
    [Meta({"x-route": "local"}), Usage(12, 0), Sampling(0.2, 0.9), Progress("asking 2 models…")],
)
def test_facts_and_notes_do_not_commit(fact) -> None:
    tracker = CommitTracker()
    assert tracker.feed(fact) is False
    assert not tracker.committed and tracker.may_retry(BUSY)
    assert tracker.failure(BROKEN) is BROKEN  # still retryable as it came


@pytest.mark.parametrize(
    "content",
    [
        TextDelta("Hel"),
        ReasoningDelta("let me see"),
        ToolCallDelta(index=0, id="c1", name="f", arguments=""),
        Done("stop"),
        REFUSED,
    ],
)
def test_the_first_content_event_commits_once(content) -> None:
    tracker = CommitTracker()
    tracker.feed(Meta({"x-route": "local"}))
    assert tracker.feed(content) is True
    assert tracker.committed
    assert tracker.feed(TextDelta("more")) is False  # only the first one commits


def test_after_the_commit_nothing_is_retried() -> None:
    tracker = CommitTracker()
    tracker.feed(TextDelta("par"))
    assert not tracker.may_retry(BUSY) and not tracker.may_retry(BROKEN)
    seen = tracker.failure(BROKEN)
    assert seen.retryable is False and seen.kind == "upstream" and seen.message == "broke"


def test_only_retryable_errors_may_be_retried_before_the_commit() -> None:
    tracker = CommitTracker()
    assert tracker.may_retry(BUSY)  # overloaded is retryable by kind
    assert tracker.may_retry(BROKEN)  # retryable by flag
    assert not tracker.may_retry(REFUSED)  # a client mistake is answered, not retried


def test_a_whole_answer_commits_only_at_its_end() -> None:
    """A client that did not ask for a stream sees nothing until the terminal: mid-answer
    failures may still be retried."""
    tracker = CommitTracker(streaming=False)
    assert tracker.feed(TextDelta("Hel")) is False
    assert tracker.feed(ToolCallDelta(index=0, id="c1", name="f", arguments="")) is False
    assert tracker.may_retry(BUSY) and tracker.failure(BROKEN) is BROKEN
    assert tracker.feed(Done("stop")) is True and tracker.committed


def test_a_whole_answer_broken_mid_way_by_its_upstream_may_still_go_elsewhere() -> None:
    """A worker killed or silent past its deadline mid-answer: its error is not retryable by
    itself (it did work), but a client waiting for the whole answer saw nothing of it."""
    lost = Error(kind="upstream", message="the worker closed the stream before [DONE]")
    silent = Error(kind="timeout", message="the worker sent nothing for 120 s mid-answer")
    whole = CommitTracker(streaming=False)
    whole.feed(TextDelta("Hel"))
    assert whole.may_retry(lost) and whole.may_retry(silent)
    # ... and if no route is left it is a 503 with Retry-After: the client may come back.
    assert whole.seen(lost) == Error(kind="unavailable", message=lost.message, retryable=True)
    assert whole.seen(TextDelta("x")) == TextDelta("x")
    assert not whole.may_retry(REFUSED) and whole.seen(REFUSED) is REFUSED  # its own fault
    streamed = CommitTracker()
    assert not streamed.may_retry(lost)  # a stream: only what says it is retryable
    streamed.feed(TextDelta("Hel"))
    assert not streamed.may_retry(silent)
