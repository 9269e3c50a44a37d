"""``HOST:PORT`` strings: parsing them, and the addresses this node tells peers to dial."""

from __future__ import annotations

import contextlib
import socket

from mesh.errors import AddressError

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})  # this machine only


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` → (host, port); ``AddressError`` for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise AddressError(f"bad address {address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def default_addresses(host: str, port: int) -> list[str]:
    """Where peers can reach us: the bound host, or this machine's addresses for a wildcard."""
    if host not in ("0.0.0.0", "::", ""):
        return [f"{host}:{port}"]
    found: list[str] = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("10.255.255.255", 1))  # no packet is sent: this only picks a route
        found.append(probe.getsockname()[0])
    with contextlib.suppress(OSError):
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            found.append(str(info[4][0]))
    found = [ip for ip in dict.fromkeys(found) if not ip.startswith("127.")]
    return [f"{ip}:{port}" for ip in [*found, "127.0.0.1"]]
