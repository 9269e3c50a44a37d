"""The tunnel frame codec: round trips, limits, and arbitrary bytes → only FrameError."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.errors import FrameError, IncompleteResponse, ProtocolViolation
from mesh.tunnel.frames import (
    HEADER_SIZE,
    MAX_PAYLOAD,
    Body,
    BodyEnd,
    Control,
    Data,
    End,
    ErrorCode,
    FrameDecoder,
    FrameType,
    InboundSequence,
    RequestHead,
    ResponseHead,
    StreamRole,
    Window,
    encode,
)

REQUEST = [
    RequestHead(
        id="r1",
        method="POST",
        path="/v1/chat/completions",
        headers={"x-session": "abc"},
        deadline=12.5,
        attempt=1,
    ),
    Body(b'{"model": "m"'),
    Body(b"}"),
    BodyEnd(),
]
RESPONSE = [
    ResponseHead(status=200, headers={"content-type": "text/event-stream"}),
    Data(b"data: 1\n\n"),
    Data(b""),
    End(),
]


def test_round_trip_every_frame_type() -> None:
    frames = [*REQUEST, *RESPONSE, End(code=ErrorCode.REJECTED, message="busy")]
    frames += [Control(kind="gossip", body={"models": ["a"], "n": 1}), Window(123456)]
    wire = b"".join(encode(f) for f in frames)
    assert FrameDecoder().feed(wire) == frames


def test_byte_by_byte_feeding_yields_the_same_frames() -> None:
    wire = b"".join(encode(f) for f in REQUEST)
    decoder = FrameDecoder()
    out = []
    for i in range(len(wire)):
        out += decoder.feed(wire[i : i + 1])
    assert out == REQUEST
    decoder.check_eof()


def test_end_ok_flag() -> None:
    assert End().ok
    assert not End(code=ErrorCode.DEADLINE).ok


def test_oversized_frame_rejected_from_its_header() -> None:
    header = bytes([FrameType.DATA]) + (MAX_PAYLOAD + 1).to_bytes(4, "big")
    with pytest.raises(FrameError, match="exceeds"):
        FrameDecoder().feed(header)
    with pytest.raises(FrameError):
        encode(Data(b"x" * (MAX_PAYLOAD + 1)))
    assert len(encode(Data(b"x" * MAX_PAYLOAD))) == MAX_PAYLOAD + HEADER_SIZE


def test_unknown_type_and_bad_json_are_frame_errors() -> None:
    with pytest.raises(FrameError, match="unknown frame type"):
        FrameDecoder().feed(b"\xee\x00\x00\x00\x00")
    bad_head = bytes([FrameType.REQUEST_HEAD]) + (3).to_bytes(4, "big") + b"{x}"
    with pytest.raises(FrameError):
        FrameDecoder().feed(bad_head)
    invalid_status = encode(ResponseHead(status=200)).replace(b"200", b"999")
    with pytest.raises(FrameError):
        FrameDecoder().feed(invalid_status)


def test_unencodable_control_body_is_a_frame_error() -> None:
    with pytest.raises(FrameError):
        encode(Control(kind="x", body={"n": 2**70}))


def test_decoder_is_poisoned_after_an_error() -> None:
    decoder = FrameDecoder()
    with pytest.raises(FrameError):
        decoder.feed(b"\xee\x00\x00\x00\x00")
    with pytest.raises(FrameError):
        decoder.feed(encode(BodyEnd()))


def test_truncated_input_is_an_error_at_eof() -> None:
    decoder = FrameDecoder()
    assert decoder.feed(encode(Data(b"hello"))[:-2]) == []
    with pytest.raises(FrameError, match="inside a frame"):
        decoder.check_eof()


def test_response_sequence_needs_end() -> None:
    seq = InboundSequence(StreamRole.RESPONSE)
    for frame in RESPONSE[:-1]:
        seq.accept(frame)
    with pytest.raises(IncompleteResponse):
        seq.check_eof()
    seq.accept(RESPONSE[-1])
    seq.check_eof()


def test_response_may_be_just_an_error_end() -> None:
    seq = InboundSequence(StreamRole.RESPONSE)
    seq.accept(End(code=ErrorCode.REJECTED))
    assert seq.complete


@pytest.mark.parametrize(
    ("role", "frames"),
    [
        (StreamRole.RESPONSE, [Data(b"x")]),  # data before head
        (StreamRole.RESPONSE, [ResponseHead(status=200), ResponseHead(status=200)]),
        (StreamRole.RESPONSE, [End(), Data(b"x")]),  # after the end
        (StreamRole.REQUEST, [Body(b"x")]),
        (StreamRole.REQUEST, [RequestHead(id="1", path="/"), BodyEnd(), Body(b"x")]),
        (StreamRole.CONTROL, [Data(b"x")]),
    ],
)
def test_out_of_order_frames_violate_the_protocol(role: StreamRole, frames: list) -> None:
    seq = InboundSequence(role)
    with pytest.raises(ProtocolViolation):
        for frame in frames:
            seq.accept(frame)


def test_empty_stream_is_incomplete() -> None:
    with pytest.raises(IncompleteResponse):
        InboundSequence(StreamRole.REQUEST).check_eof()


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512), st.integers(min_value=1, max_value=64))
def test_arbitrary_bytes_raise_only_frame_error(data: bytes, chunk: int) -> None:
    decoder = FrameDecoder()
    try:
        for i in range(0, len(data), chunk):
            decoder.feed(data[i : i + chunk])
        decoder.check_eof()
    except FrameError:
        pass


_json_text = st.text(max_size=40)
_frames = st.one_of(
    st.builds(
        RequestHead,
        id=_json_text,
        path=_json_text,
        headers=st.dictionaries(_json_text, _json_text, max_size=3),
        deadline=st.none() | st.floats(min_value=0, max_value=1e6),
        attempt=st.integers(0, 3),
    ),
    st.builds(Body, st.binary(max_size=200)),
    st.just(BodyEnd()),
    st.builds(ResponseHead, status=st.integers(100, 599)),
    st.builds(Data, st.binary(max_size=200)),
    st.builds(End, code=st.sampled_from(ErrorCode), message=_json_text),
    st.builds(
        Control, kind=_json_text, body=st.dictionaries(_json_text, st.integers(-(2**63), 2**63 - 1))
    ),
    st.builds(Window, st.integers(0, 2**64 - 1)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_frames, max_size=8), st.integers(min_value=1, max_value=50))
def test_any_frames_round_trip_in_any_chunking(frames: list, chunk: int) -> None:
    wire = b"".join(encode(f) for f in frames)
    decoder = FrameDecoder()
    out = []
    for i in range(0, len(wire), chunk):
        out += decoder.feed(wire[i : i + chunk])
    decoder.check_eof()
    assert out == frames


@settings(max_examples=200, deadline=None)
@given(st.lists(_frames, min_size=1, max_size=4), st.data())
def test_corrupted_frames_raise_only_frame_error(frames: list, data: st.DataObject) -> None:
    wire = bytearray(b"".join(encode(f) for f in frames))
    for _ in range(data.draw(st.integers(1, 4))):
        wire[data.draw(st.integers(0, len(wire) - 1))] = data.draw(st.integers(0, 255))
    try:
        FrameDecoder().feed(bytes(wire))
    except FrameError:
        pass
