"""TunnelStream logic without a network: credit window, terminal frames, resets, loss."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.errors import ClosedError, ConnectionLost, IncompleteResponse, MeshError, StreamReset
from mesh.tunnel.frames import (
    Body,
    BodyEnd,
    Data,
    End,
    ErrorCode,
    RequestHead,
    ResponseHead,
    Window,
)
from mesh.tunnel.testing import StreamPipe


async def settle() -> None:
    """Let call_soon deliveries run (a few loop iterations)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def exchange(pipe: StreamPipe) -> None:
    await pipe.requester.send(RequestHead(id="1", path="/"))
    await pipe.requester.send(Body(b"q"))
    await pipe.requester.send(BodyEnd())


async def test_full_exchange_completes_both_halves() -> None:
    pipe = StreamPipe()
    await exchange(pipe)
    assert [f async for f in pipe.responder] == [
        RequestHead(id="1", path="/"),
        Body(b"q"),
        BodyEnd(),
    ]
    for frame in (ResponseHead(status=200), Data(b"a"), End()):
        await pipe.responder.send(frame)
    assert [f async for f in pipe.requester] == [ResponseHead(status=200), Data(b"a"), End()]
    await settle()
    assert pipe.requester.done and pipe.responder.done
    assert pipe.requester_host.done and pipe.responder_host.done


async def test_sender_waits_for_credit_and_resumes() -> None:
    window = 4096
    pipe = StreamPipe(window=window)
    await exchange(pipe)
    await pipe.responder.send(ResponseHead(status=200))

    async def flood() -> None:
        for _ in range(64):
            await pipe.responder.send(Data(b"x" * 512))
        await pipe.responder.send(End())

    sender = asyncio.create_task(flood())
    await settle()
    assert not sender.done()  # blocked: 64 × 512 B is far beyond a 4 KiB window
    assert pipe.responder.unconsumed_sent <= window + 600
    got = 0
    async for frame in pipe.requester:
        if isinstance(frame, Data):
            got += len(frame.data)
    await asyncio.wait_for(sender, 5)
    assert got == 64 * 512


async def test_recv_batch_hands_out_everything_that_arrived_then_nothing_after_end() -> None:
    pipe = StreamPipe()
    await exchange(pipe)
    frames = [ResponseHead(status=200), *(Data(b"t%d" % i) for i in range(5)), End()]
    for frame in frames:
        await pipe.responder.send(frame, defer=True)
    await settle()
    assert await pipe.requester.recv_batch() == frames
    assert await pipe.requester.recv_batch() == []
    await settle()
    assert pipe.requester.done  # End handed out: our FIN went, like recv() does


async def test_recv_batch_raises_like_recv_once_the_arrived_frames_are_out() -> None:
    pipe = StreamPipe()
    await exchange(pipe)
    await pipe.responder.send(ResponseHead(status=200))
    await pipe.responder.send(Data(b"a"))
    pipe.responder.reset(ErrorCode.UPSTREAM_FAILED)
    await settle()
    assert await pipe.requester.recv_batch() == [ResponseHead(status=200), Data(b"a")]
    with pytest.raises(StreamReset):
        await pipe.requester.recv_batch()


async def test_window_frames_are_not_for_users() -> None:
    with pytest.raises(ValueError):
        await StreamPipe().requester.send(Window(1))


async def test_fin_without_end_is_incomplete() -> None:
    pipe = StreamPipe()
    await exchange(pipe)
    await pipe.responder.send(ResponseHead(status=200))
    pipe.responder.finish()
    assert await pipe.requester.recv() == ResponseHead(status=200)
    with pytest.raises(IncompleteResponse):
        await pipe.requester.recv()


async def test_reset_reaches_reader_with_its_code() -> None:
    pipe = StreamPipe()
    await exchange(pipe)
    pipe.responder.reset(ErrorCode.DEADLINE)
    with pytest.raises(StreamReset) as info:
        await pipe.requester.recv()
    assert info.value.code == ErrorCode.DEADLINE
    with pytest.raises(ClosedError):
        await pipe.responder.send(Data(b"x"))


async def test_stop_sending_fails_the_sender() -> None:
    pipe = StreamPipe()
    await exchange(pipe)
    pipe.requester.reset(ErrorCode.CANCELLED)
    await settle()
    with pytest.raises(StreamReset) as info:
        await pipe.responder.send(ResponseHead(status=200))
    assert info.value.code == ErrorCode.CANCELLED


async def test_aclose_cancels_an_unfinished_exchange() -> None:
    pipe = StreamPipe()
    async with pipe.requester as stream:
        await stream.send(RequestHead(id="1", path="/"))
    await settle()
    assert await pipe.responder.recv() == RequestHead(id="1", path="/")
    with pytest.raises(StreamReset) as info:
        await pipe.responder.recv()
    assert info.value.code == ErrorCode.CANCELLED


async def test_connection_loss_wakes_a_blocked_reader_and_sender() -> None:
    pipe = StreamPipe(window=1024)
    await exchange(pipe)
    reader = asyncio.create_task(pipe.requester.recv())
    await settle()
    assert not reader.done()  # nothing to read yet

    async def flood() -> None:
        await pipe.responder.send(ResponseHead(status=200))
        while True:
            await pipe.responder.send(Data(b"x" * 512))

    sender = asyncio.create_task(flood())
    await settle()
    assert await asyncio.wait_for(reader, 5) == ResponseHead(status=200)
    assert not sender.done()  # blocked on credit: nobody reads
    reader = asyncio.create_task(pipe.requester.recv())
    pipe.lose()
    assert isinstance(await asyncio.wait_for(reader, 5), Data)  # delivered before the loss
    with pytest.raises(ConnectionLost):
        while True:
            await pipe.requester.recv()
    with pytest.raises(ConnectionLost):
        await asyncio.wait_for(sender, 5)


async def test_reader_drains_frames_before_the_error() -> None:
    pipe = StreamPipe()
    await exchange(pipe)
    await pipe.responder.send(ResponseHead(status=200))
    await pipe.responder.send(End())
    await settle()
    pipe.lose()
    assert await pipe.requester.recv() == ResponseHead(status=200)
    assert await pipe.requester.recv() == End()
    assert await pipe.requester.recv() is None


async def test_wait_broken_reports_a_reset_after_the_request_was_read() -> None:
    pipe = StreamPipe()
    await exchange(pipe)
    assert [f async for f in pipe.responder][-1] == BodyEnd()
    assert await pipe.responder.recv() is None  # recv is done with this stream for good
    watcher = asyncio.create_task(pipe.responder.wait_broken())
    await settle()
    assert not watcher.done()
    pipe.requester.reset(ErrorCode.CANCELLED)
    error = await asyncio.wait_for(watcher, 5)
    assert isinstance(error, StreamReset) and error.code == ErrorCode.CANCELLED


async def test_wait_broken_reports_connection_loss() -> None:
    pipe = StreamPipe()
    await exchange(pipe)
    watcher = asyncio.create_task(pipe.responder.wait_broken())
    pipe.lose()
    assert isinstance(await asyncio.wait_for(watcher, 5), ConnectionLost)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=6), st.booleans())
def test_arbitrary_peer_bytes_surface_only_mesh_errors(chunks: list[bytes], fin: bool) -> None:
    async def scenario() -> None:
        pipe = StreamPipe()
        for i, chunk in enumerate(chunks):
            pipe.responder.data_received(chunk, fin and i == len(chunks) - 1)
        if fin and not chunks:
            pipe.responder.data_received(b"", True)
        try:
            while True:
                frame = await asyncio.wait_for(pipe.responder.recv(), 0.05)
                if frame is None:
                    break
        except (MeshError, TimeoutError):
            pass  # TimeoutError: no EOF yet, the stream simply waits for more

    asyncio.run(scenario())
