"""The control stream's dispatch: unknown kinds and bodies a handler refuses are counted and
logged at most once a minute per reason, never raised (so never a reason to end a link)."""

from __future__ import annotations

import logging

import pytest

from mesh.control_inbox import MAX_REASONS, ControlInbox, IgnoredInput
from mesh.errors import GossipDecodeError
from mesh.gossip import gossip_from_dict


def test_a_reason_is_logged_once_a_minute_with_the_count_since() -> None:
    tally = IgnoredInput(log_every_s=60.0)
    assert tally.note("x", now=0.0) == 1  # the first: logged at once
    assert tally.note("x", now=1.0) == 0
    assert tally.note("x", now=59.0) == 0
    assert tally.note("y", now=59.5) == 1  # another reason has its own minute
    assert tally.note("x", now=60.0) == 3  # three since the last line
    assert tally.counts == {"x": 4, "y": 1}


def test_reasons_are_bounded() -> None:
    tally = IgnoredInput()
    for i in range(MAX_REASONS + 10):
        tally.note(f"unknown gossip type 't{i}'", now=float(i))
    assert len(tally.counts) == MAX_REASONS + 1 and tally.counts["other"] == 10


def test_unknown_kinds_and_refused_bodies_are_counted_not_raised(caplog) -> None:
    seen: list[dict] = []

    def gossip(peer_id: str, body: dict) -> None:
        seen.append(gossip_from_dict(body).model_dump())

    inbox = ControlInbox({"gossip": gossip})
    with caplog.at_level(logging.INFO, logger="mesh.control_inbox"):
        inbox.receive("p" * 64, "telemetry", {"anything": 1}, now=0.0)
        inbox.receive("p" * 64, "gossip", {"type": "future_thing", "x": 1}, now=0.0)
        inbox.receive("p" * 64, "gossip", {"type": "state", "node_id": "n", "cache": {"m": 1}}, 0.0)
        inbox.receive("p" * 64, "gossip", {"type": "leave", "node_id": "n", "new": True}, now=0.0)
    assert seen == [{"type": "leave", "node_id": "n"}]  # unknown fields ignored, message used
    assert inbox.ignored.counts == {
        "unknown control kind 'telemetry'": 1,
        "unknown gossip type 'future_thing'": 1,
        "bad gossip message: 1 errors": 1,
    }
    assert len(caplog.records) == 3, [r.getMessage() for r in caplog.records]
    assert "pppppppppppp" in caplog.records[0].getMessage()


def test_a_handler_bug_is_not_swallowed() -> None:
    def broken(peer_id: str, body: dict) -> None:
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        ControlInbox({"gossip": broken}).receive("p", "gossip", {}, now=0.0)


def test_an_unknown_gossip_type_is_a_decode_error_of_its_own() -> None:
    with pytest.raises(GossipDecodeError, match="unknown gossip type 'x'"):
        gossip_from_dict({"type": "x"})
