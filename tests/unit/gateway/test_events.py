"""The internal events' JSON form (what tunnels carry): every event round-trips, and old peers'
dicts without newer optional fields still decode."""

from __future__ import annotations

import orjson
import pytest

from gateway.events import (
    Done,
    Error,
    EventDecodeError,
    Meta,
    Progress,
    ReasoningDelta,
    Sampling,
    TextDelta,
    TokenLogprob,
    ToolCallDelta,
    Usage,
    event_from_dict,
    event_to_dict,
)

EVENTS = [
    ReasoningDelta("hm"),
    TextDelta("hi", logprob=-0.25),
    TextDelta("hi!", logprobs=(TokenLogprob("hi", -0.5, (TokenLogprob("hi", -0.5),)),)),
    ToolCallDelta(0, id="c", name="f", arguments="{}"),
    Progress("asking 3 models…"),
    Usage(3, 2, 1),
    Sampling(0.2, 0.9, top_k=40),
    Meta({"x-route": "local"}),
    Done("length"),
    Done("stop", stop_sequence="###"),
    Error(kind="upstream", message="boom", retryable=True, code="x", details={"a": 1}),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_events_round_trip_through_json(event) -> None:
    wire = orjson.loads(orjson.dumps(event_to_dict(event)))
    assert event_from_dict(wire) == event


def test_done_stop_sequence_is_on_the_wire_and_optional() -> None:
    assert event_to_dict(Done("stop", stop_sequence="END")) == {
        "t": "done",
        "finish_reason": "stop",
        "stop_sequence": "END",
    }
    # A peer that predates the field sends only the finish reason.
    assert event_from_dict({"t": "done", "finish_reason": "stop"}) == Done("stop")


def test_progress_has_its_own_tag_not_reasoning() -> None:
    # A peer must not mistake the note for the model's reasoning.
    assert event_to_dict(Progress("asking 2 models…")) == {
        "t": "progress",
        "text": "asking 2 models…",
    }


def test_unknown_fields_are_a_decode_error() -> None:
    with pytest.raises(EventDecodeError):
        event_from_dict({"t": "done", "finish_reason": "stop", "bogus": 1})


def test_a_text_deltas_token_logprobs_cross_as_json_and_come_back_whole() -> None:
    """Chat logprobs served by a peer: the entries, their top alternatives and the mean."""
    top = (TokenLogprob("a", -0.1), TokenLogprob("b", -2.5))
    delta = TextDelta("ab", logprobs=(TokenLogprob("a", -0.1, top), TokenLogprob("b", -0.3)))
    wire = orjson.loads(orjson.dumps(event_to_dict(delta)))
    assert wire["logprobs"][0] == {
        "token": "a",
        "logprob": -0.1,
        "top_logprobs": [
            {"token": "a", "logprob": -0.1, "top_logprobs": []},
            {"token": "b", "logprob": -2.5, "top_logprobs": []},
        ],
    }
    back = event_from_dict(wire)
    assert back == delta and back.logprob == pytest.approx(-0.2)
    with pytest.raises(EventDecodeError):
        event_from_dict({"t": "text", "text": "x", "logprobs": [{"token": "x"}]})
