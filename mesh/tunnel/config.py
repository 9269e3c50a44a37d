"""Tunnel configuration: the ALPN, the default port and the tuning knobs."""

from __future__ import annotations

from dataclasses import dataclass

ALPN = "mlx-mesh/1"
DEFAULT_PORT = 9338


@dataclass(frozen=True)
class TunnelConfig:
    """Tunnel tuning. A peer silent for ``ping_timeout`` s is dead: detected within
    ``ping_timeout`` s (3.5 s with the defaults, under the 5 s the design asks for)."""

    ping_interval: float = 1.0
    ping_timeout: float = 3.5
    idle_timeout: float = 30.0
    handshake_timeout: float = 10.0
    stream_window: int = 256 * 1024  # unconsumed bytes a sender may have in flight per stream
    max_held_streams: int = 16  # peer streams held while unauthenticated (each ≤ one window)
    # Strangers get nothing: a connection not authenticated this long after it began is closed,
    # may send at most this many request-stream bytes first, and only so many may wait at once.
    auth_deadline: float = 15.0
    max_preauth_bytes: int = 1 << 20
    max_preauth_per_address: int = 8
    max_preauth_total: int = 64
    max_datagram_size: int = 1200
    # A response's tokens after its first may wait this long after the previous flush to
    # share datagrams (protocol.py): a real engine's tokens come far apart and never wait.
    flush_delay: float = 0.005
    close_grace: float = 1.0  # how long close() waits for connections to finish closing
