"""The keep-alive policy, without a connection: when it pings, when silence is death, the RTT."""

from mesh.tunnel.keepalive import WAKE_SLACK_S, KeepAlive


def test_pings_on_its_interval_and_wakes_for_the_silence_deadline_first():
    keepalive = KeepAlive(interval=1.0, timeout=3.5)
    assert keepalive.ping_due(0.0)
    keepalive.ping(0.0)
    assert not keepalive.ping_due(0.5)
    assert keepalive.ping_due(1.0)
    assert keepalive.wake_at(last_heard=0.0) == 1.0
    assert keepalive.wake_at(last_heard=-3.0) == -3.0 + 3.5 + WAKE_SLACK_S


def test_silence_not_a_lost_ping_is_death():
    keepalive = KeepAlive(interval=1.0, timeout=3.5)
    assert not keepalive.is_dead(3.5)
    assert keepalive.is_dead(3.51)


def test_rtt_is_smoothed_over_the_latest_pings_acks_only():
    keepalive = KeepAlive(interval=1.0, timeout=3.5)
    stale = keepalive.ping(0.0)
    latest = keepalive.ping(1.0)
    keepalive.acked(stale, 1.5)  # superseded: no sample
    assert keepalive.rtt is None
    keepalive.acked(latest, 1.1)
    assert keepalive.rtt is not None and abs(keepalive.rtt - 0.1) < 1e-9
    keepalive.acked(keepalive.ping(2.0), 2.6)
    assert abs(keepalive.rtt - (0.8 * 0.1 + 0.2 * 0.6)) < 1e-9
    probe = keepalive.next_uid()  # a probe's ack gives no sample either
    keepalive.acked(probe, 9.0)
    assert abs(keepalive.rtt - (0.8 * 0.1 + 0.2 * 0.6)) < 1e-9


def test_acks_after_stop_give_no_sample():
    keepalive = KeepAlive(interval=1.0, timeout=3.5)
    uid = keepalive.ping(0.0)
    keepalive.stop()
    keepalive.acked(uid, 0.2)
    assert keepalive.rtt is None
