"""The outbox, without aioquic: what goes at once, what waits for the flush, and in what order."""

from mesh.tunnel.coalesce import Outbox


def _outbox() -> tuple[Outbox, list[tuple[int, bytes, bool]]]:
    sent: list[tuple[int, bytes, bool]] = []
    return Outbox(lambda sid, data, fin: sent.append((sid, data, fin))), sent


def test_deferred_writes_wait_and_leave_as_one_write_per_stream():
    outbox, sent = _outbox()
    assert outbox.write(1, b"a", False, defer=True)
    assert outbox.write(1, b"b", False, defer=True)
    assert outbox.write(5, b"x", False, defer=True)
    assert sent == []
    assert outbox.flush()
    assert sent == [(1, b"ab", False), (5, b"x", False)]
    assert not outbox.flush()  # nothing held any more


def test_a_write_that_goes_now_takes_its_own_streams_held_writes_only():
    outbox, sent = _outbox()
    outbox.write(1, b"a", False, defer=True)
    outbox.write(5, b"x", False, defer=True)
    assert not outbox.write(1, b"b", False, defer=False)
    assert sent == [(1, b"ab", False)]
    outbox.flush()
    assert sent[-1] == (5, b"x", False)


def test_a_deferred_end_goes_at_once_unless_others_wait_for_the_flush():
    outbox, sent = _outbox()
    assert not outbox.write(1, b"end", True, defer=True)
    assert sent == [(1, b"end", True)]
    outbox.write(5, b"x", False, defer=True)
    assert outbox.write(9, b"end", True, defer=True)


def test_bare_fins_ride_with_a_write_that_leaves_now():
    outbox, sent = _outbox()
    outbox.write(5, b"x", False, defer=True)
    outbox.write(1, b"", True, defer=True)  # finish() after End
    outbox.write(9, b"req", False, defer=False)
    assert sent == [(9, b"req", False), (1, b"", True)]


def test_before_flush_callbacks_write_into_the_flush_and_a_failing_one_stops_nothing():
    outbox, sent = _outbox()

    def broken() -> None:
        raise RuntimeError("bug")

    outbox.before_flush(1, lambda: outbox.write(1, b"merged", False, defer=True))
    outbox.before_flush(5, broken)
    assert outbox.flush()
    assert sent == [(1, b"merged", False)]


def test_a_reset_stream_drops_what_it_held():
    outbox, sent = _outbox()
    outbox.write(1, b"a", False, defer=True)
    outbox.drop(1)
    assert not outbox.flush()
    assert sent == []
