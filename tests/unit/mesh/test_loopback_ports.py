"""Loopback ports for child processes (split ranks, lab nodes): drawn below the kernel's
ephemeral range, so no socket opened before the child binds (a connection's local end, another
``bind(0)``) can be handed the same port."""

from __future__ import annotations

import socket

import pytest

from mesh.loopback_ports import ephemeral_range, free_port, free_ports


@pytest.mark.parametrize("kind", [socket.SOCK_STREAM, socket.SOCK_DGRAM])
def test_a_port_is_free_and_below_the_ephemeral_range(kind: int) -> None:
    low, high = ephemeral_range()
    assert 1024 <= low < high
    ports = {free_port(kind) for _ in range(20)}
    assert all(1024 <= port < low for port in ports)
    assert len(ports) > 1  # drawn, not one fixed port every run would fight over
    for port in ports:
        with socket.socket(socket.AF_INET, kind) as sock:
            sock.bind(("127.0.0.1", port))


def test_ports_drawn_together_are_distinct_and_bindable_together() -> None:
    ports = free_ports(6)
    assert len(set(ports)) == 6
    socks = [socket.socket() for _ in ports]
    try:
        for sock, port in zip(socks, ports, strict=True):
            sock.bind(("127.0.0.1", port))
    finally:
        for sock in socks:
            sock.close()


def test_a_taken_port_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the draw forced onto a port someone holds, the next draw is handed out instead."""
    busy, spare = free_ports(2)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", busy))
        draws = iter([busy, busy, spare])
        monkeypatch.setattr("mesh.loopback_ports._DRAW.randrange", lambda a, b: next(draws))
        assert free_ports(1) == [spare]


def test_the_ports_bind_0_hands_out_are_in_the_range_we_avoid() -> None:
    """The premise: ``bind(0)`` draws from the ephemeral range (what the old pick did)."""
    low, high = ephemeral_range()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        assert low <= sock.getsockname()[1] <= high
