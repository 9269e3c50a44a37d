"""Loopback ports for processes a node starts (split ranks) and a lab starts (nodes).

A port ``bind(0)`` hands out is one the kernel hands out again – to an outgoing connection or to
another ``bind(0)`` – between our closing the probe and the child binding it, and the child
then fails with "address already in use" now and then. The kernel never picks a port below its
ephemeral range by itself, so one drawn there stays free unless someone names it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_DRAW = random.SystemRandom()
_SPAN = 16384  # how far below the ephemeral range ports are drawn


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel picks for ``bind(0)`` and outgoing connections (Linux says;
    elsewhere IANA's 49152-65535, macOS's default)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def free_ports(count: int, kind: int = socket.SOCK_STREAM) -> list[int]:
    """``count`` distinct loopback ports free now (TCP by default, UDP for mesh endpoints),
    drawn below the ephemeral range; all held bound at once while drawing, so none repeats."""
    low, _ = ephemeral_range()
    held: list[socket.socket] = []
    try:
        for _ in range(200 + 20 * count):
            if len(held) == count:
                break
            probe = socket.socket(socket.AF_INET, kind)
            try:
                probe.bind(("127.0.0.1", _DRAW.randrange(max(1024, low - _SPAN), low)))
            except OSError:
                probe.close()
                continue
            held.append(probe)
        while len(held) < count:  # a crowded range: the kernel's picks
            probe = socket.socket(socket.AF_INET, kind)
            probe.bind(("127.0.0.1", 0))
            held.append(probe)
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """One port as :func:`free_ports` draws them."""
    (port,) = free_ports(1, kind)
    return port
