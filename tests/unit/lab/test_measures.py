"""Pure parts of the lab probe: SSE framing, per-API stream readers, statistics, the row schema."""

from __future__ import annotations

import itertools

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from lab.report import RowWriter, read_rows, render_markdown
from lab.rows import Outcome, ProbeRow
from lab.sse import SSEDecoder, SSEFrame
from lab.stats import percentile, summarize
from lab.wire import build_body, make_reader, parse_nonstream, sentinel_passed

# --- SSE -----------------------------------------------------------------------------------------

STREAM = (
    b": keep-alive\n\n"
    b'event: message_start\ndata: {"a": 1}\n\n'
    b"data: line one\r\ndata: line two\r\n\r\n"
    b"id: 7\rdata: cr only\r\r"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    SSEFrame("message_start", '{"a": 1}'),
    SSEFrame("message", "line one\nline two"),
    SSEFrame("message", "cr only", id="7"),
    SSEFrame("message", "[DONE]", id="7"),
]


def test_sse_decodes_all_line_endings_and_comments() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(STREAM) == EXPECTED
    assert decoder.comments == 1
    assert not decoder.pending


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_sse_frames_do_not_depend_on_chunk_boundaries(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(STREAM)]
    decoder = SSEDecoder()
    frames = []
    for start, end in itertools.pairwise(bounds):
        frames += decoder.feed(STREAM[start:end])
    assert frames == EXPECTED


def test_sse_empty_read_between_cr_and_lf_keeps_the_pair() -> None:
    # Found by the property test above: cuts=[66, 66] split a CRLF with an empty chunk between.
    cr_at = STREAM.index(b"\r\n")
    decoder = SSEDecoder()
    frames = (
        decoder.feed(STREAM[: cr_at + 1]) + decoder.feed(b"") + decoder.feed(STREAM[cr_at + 1 :])
    )
    assert frames == EXPECTED


def test_sse_strips_bom_split_across_chunks_and_flags_unfinished_frames() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"\xef\xbb") == []
    assert decoder.feed(b"\xbfdata: x\n\n") == [SSEFrame("message", "x")]
    decoder.feed(b"data: half")
    assert decoder.pending


def test_sse_multibyte_text_split_across_chunks() -> None:
    raw = "data: héllo ✓\n\n".encode()
    decoder = SSEDecoder()
    frames = [f for i in range(len(raw)) for f in decoder.feed(raw[i : i + 1])]
    assert frames == [SSEFrame("message", "héllo ✓")]


# --- stream readers ------------------------------------------------------------------------------


def _feed(api: str, frames: list[tuple[str, dict | str]]):
    reader = make_reader(api)  # type: ignore[arg-type]
    carried = [
        reader.feed(event, data if isinstance(data, str) else orjson.dumps(data).decode())
        for event, data in frames
    ]
    return reader.state, carried


def test_chat_reader_collects_text_usage_and_done() -> None:
    state, carried = _feed(
        "chat",
        [
            ("message", {"choices": [{"delta": {"role": "assistant"}}]}),
            ("message", {"choices": [{"delta": {"content": "Hel"}}]}),
            ("message", {"choices": [{"delta": {"reasoning_content": "hmm"}}]}),
            ("message", {"choices": [{"delta": {"content": "lo"}, "finish_reason": "stop"}]}),
            ("message", {"choices": [], "usage": {"completion_tokens": 3}}),
            ("message", "[DONE]"),
        ],
    )
    assert carried == [False, True, False, True, False, False]
    assert (state.terminal, state.text, state.tokens) == ("ok", "Hello", 3)


def test_chat_reader_error_chunk_wins_over_done() -> None:
    state, _ = _feed(
        "chat",
        [
            ("message", {"error": {"message": "peer lost", "type": "upstream"}}),
            ("message", "[DONE]"),
        ],
    )
    assert (state.terminal, state.error) == ("error", "peer lost")


def test_responses_reader() -> None:
    state, carried = _feed(
        "responses",
        [
            ("response.created", {"type": "response.created", "response": {}}),
            ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "Hi"}),
            (
                "response.completed",
                {"type": "response.completed", "response": {"usage": {"output_tokens": 1}}},
            ),
        ],
    )
    assert carried == [False, True, False]
    assert (state.terminal, state.text, state.tokens) == ("ok", "Hi", 1)
    failed, _ = _feed(
        "responses",
        [("response.failed", {"type": "response.failed", "response": {"error": {"message": "x"}}})],
    )
    assert (failed.terminal, failed.error) == ("error", "x")


def test_messages_reader() -> None:
    state, carried = _feed(
        "messages",
        [
            ("message_start", {"type": "message_start", "message": {"usage": {}}}),
            ("ping", {"type": "ping"}),
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "delta": {"type": "thinking_delta", "thinking": "t"},
                },
            ),
            (
                "content_block_delta",
                {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "ok"}},
            ),
            ("message_delta", {"type": "message_delta", "usage": {"output_tokens": 4}}),
            ("message_stop", {"type": "message_stop"}),
        ],
    )
    assert carried == [False, False, False, True, False, False]
    assert (state.terminal, state.text, state.tokens) == ("ok", "ok", 4)
    err, _ = _feed(
        "messages",
        [("error", {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})],
    )
    assert (err.terminal, err.error) == ("error", "busy")


def test_reader_rejects_malformed_data_and_unexpected_done() -> None:
    bad, _ = _feed("chat", [("message", "{not json")])
    assert bad.terminal == "error" and "malformed" in (bad.error or "")
    done, _ = _feed("messages", [("message", "[DONE]")])
    assert done.terminal == "error"


def test_bodies_turn_thinking_off_at_temperature_zero() -> None:
    chat = build_body("chat", "m", "p", stream=True, max_tokens=5)
    assert chat["chat_template_kwargs"] == {"enable_thinking": False} and chat["temperature"] == 0
    assert chat["stream_options"] == {"include_usage": True}
    assert build_body("messages", "m", "p", stream=False, max_tokens=5)["thinking"] == {
        "type": "disabled"
    }
    responses = build_body("responses", "m", "p", stream=False, max_tokens=5)
    assert responses["max_output_tokens"] == 5 and responses["input"] == "p"


def test_nonstream_parsing_and_sentinel() -> None:
    assert parse_nonstream(
        "chat",
        {"choices": [{"message": {"content": "Pineapple."}}], "usage": {"completion_tokens": 2}},
    ) == ("Pineapple.", 2)
    assert parse_nonstream(
        "responses",
        {"output": [{"type": "message", "content": [{"type": "output_text", "text": "a"}]}]},
    ) == ("a", None)
    assert parse_nonstream(
        "messages", {"content": [{"type": "text", "text": "b"}], "usage": {"output_tokens": 1}}
    ) == ("b", 1)
    assert sentinel_passed("Pineapple.", "pineapple")
    assert not sentinel_passed("pineapples", "pineapple")
    assert not sentinel_passed("", "pineapple")


# --- statistics and rows -------------------------------------------------------------------------


def _row(**kw) -> ProbeRow:
    base = dict(
        t=1.0, url="http://x", kind="stream", model="m", api="chat", outcome="ok", duration_s=1.0
    )
    return ProbeRow(**(base | kw))


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summary_counts_rates_and_percentiles() -> None:
    rows = [
        _row(route="local", ttft_s=0.1, tok_s=10.0),
        _row(route="local", ttft_s=0.3, tok_s=30.0),
        _row(route="peer", ttft_s=0.2, tok_s=20.0),
        _row(outcome="error_event", error="x"),
        _row(outcome="hung"),
        _row(kind="sentinel", outcome="ok", route="local", sentinel_ok=False, ttft_s=0.5),
        _row(kind="models", model="*", api=None, outcome="ok"),
    ]
    summary = summarize(rows)
    assert (summary.requests, summary.ok, summary.hung) == (7, 5, 1)
    assert summary.outcomes == {"error_event": 1, "hung": 1, "ok": 5}
    chat = next(g for g in summary.groups if g.api == "chat")
    assert (chat.requests, chat.ok, chat.proper_failures, chat.improper_failures) == (6, 4, 1, 1)
    assert chat.success_rate == pytest.approx(4 / 6)
    assert chat.ttft_p50_s == pytest.approx(0.2)  # stream rows only: the sentinel's 0.5 is out
    assert chat.tok_s_p50 == pytest.approx(20.0)
    assert (chat.sentinel_checked, chat.sentinel_passed) == (1, 0)
    routes = {g.route: g for g in summary.routes}
    assert set(routes) == {"local", "peer", "-"}
    assert routes["local"].ttft_p95_s == pytest.approx(0.29)
    assert summary.ab == []
    md = render_markdown(summary)
    assert "**hung: 1**" in md and "| a | m | peer |" in md


def test_ab_ratios_are_b_over_a() -> None:
    rows = [
        _row(target="a", ttft_s=0.2, tok_s=10.0),
        _row(target="b", ttft_s=0.1, tok_s=30.0),
        _row(target="b", outcome="http_error", status=503),
    ]
    (ratio,) = summarize(rows).ab
    assert ratio.ttft_p50_b_over_a == pytest.approx(0.5)
    assert ratio.tok_s_p50_b_over_a == pytest.approx(3.0)
    assert ratio.success_rate_b_over_a == pytest.approx(0.5)


def test_row_schema_round_trips_through_jsonl_and_rejects_unknown_fields(tmp_path) -> None:
    writer = RowWriter(tmp_path / "rows.jsonl")
    row = _row(route="peer", peer="abc", text="hi", tokens=3)
    writer.write(row)
    writer.close()
    with (tmp_path / "rows.jsonl").open("ab") as f:
        f.write(b'{"t": 1.0, "url"')  # a torn last line from a killed writer
    assert read_rows(tmp_path / "rows.jsonl") == [row]
    with pytest.raises(ValidationError):
        ProbeRow.model_validate({**row.model_dump(), "surprise": 1})
    with pytest.raises(ValidationError):
        _row(outcome="fine")
    assert _row(outcome="hung").outcome is Outcome.HUNG


def test_the_gateways_trailing_route_comment_is_a_fact_not_a_keep_alive() -> None:
    decoder = SSEDecoder()
    frames = decoder.feed(b": keep-alive\n\n: route x-peer=abc123 x-attempts=3\n\ndata: {}\n\n")
    assert len(frames) == 1 and decoder.comments == 1
    assert decoder.route_facts == {"x-peer": "abc123", "x-attempts": "3"}
