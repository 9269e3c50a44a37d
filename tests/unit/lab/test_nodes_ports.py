"""Lab node ports: drawn below the kernel's ephemeral range, so no socket opened before the node
binds (a connection's local end, another test's ``bind(0)``) can be handed the same port."""

from __future__ import annotations

import socket

import pytest

from lab.nodes import ephemeral_range, free_port


@pytest.mark.parametrize("kind", [socket.SOCK_STREAM, socket.SOCK_DGRAM])
def test_a_lab_port_is_free_and_below_the_ephemeral_range(kind: int) -> None:
    low, high = ephemeral_range()
    assert 1024 <= low < high
    ports = {free_port(kind) for _ in range(20)}
    assert all(1024 <= port < low for port in ports)
    assert len(ports) > 1  # drawn, not one fixed port every lab run would fight over
    for port in ports:
        with socket.socket(socket.AF_INET, kind) as sock:
            sock.bind(("127.0.0.1", port))


def test_the_ports_bind_0_hands_out_are_in_the_range_lab_ports_avoid() -> None:
    """The premise: ``bind(0)`` draws from the ephemeral range (what the old lab did)."""
    low, high = ephemeral_range()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        assert low <= sock.getsockname()[1] <= high
