"""The gateway's typed configuration; the CLI builds it, core code never reads the environment."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from gateway import __version__

# Names that always mean this machine. Any IP address literal is accepted as a Host too: a DNS
# rebinding attack needs a name of the attacker's, so only names have to be listed.
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain"})


def is_ip_literal(name: str) -> bool:
    """An IP address rather than a name (the Host guard lets any address through: rebinding
    needs a name the attacker controls)."""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class GatewayConfig:
    api_key: str | None = (
        None  # Bearer or x-api-key; None = open (loopback only, enforced by mesh up)
    )
    max_body_bytes: int = 8 * 1024 * 1024
    max_in_flight: int = 64
    keepalive_s: float = 15.0
    header_wait_s: float = 2.0
    retry_backoff_ms: int = 750
    version: str = __version__
    request_log: Path | None = None
    # Host names clients may call this gateway by (besides IP literals): the loopback names, plus
    # whatever else the node is reached by (its advertised names, e.g. ``mac-mini.local``, a DNS
    # name). A name outside it is refused (421, DNS rebinding), and so is a state-changing
    # request from a browser page of another origin (403). "*" accepts any name.
    allowed_hosts: frozenset[str] = LOOPBACK_NAMES
    # Stored Responses (``store: true``): a SQLite file (the node's is ``<home>/responses.sqlite3``);
    # None keeps them in memory. Oldest dropped first beyond either bound.
    response_store: Path | None = None
    response_store_max: int = 10_000
    response_store_max_bytes: int = 256 << 20
