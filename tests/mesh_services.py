"""In-process ``MeshService`` nodes for the end-to-end tests: a config for nodes on loopback that
find each other fast."""

from __future__ import annotations

from typing import Any

from mesh.service import MeshConfig
from mesh.tunnel.config import TunnelConfig

# Dead peers are noticed in ~2 s; a shorter ping timeout flakes on a loaded 2-core machine.
FAST_TUNNEL = TunnelConfig(ping_interval=0.5, ping_timeout=1.5, handshake_timeout=3.0)


def quick_mesh_config(**overrides: Any) -> MeshConfig:
    """Any free port, no LAN discovery, gossip and redials every 0.2 s, ``FAST_TUNNEL``."""
    base: dict[str, Any] = dict(
        port=0,
        discovery=False,
        gossip_interval_s=0.2,
        redial_s=0.2,
        max_redial_backoff_s=0.5,
        tunnel=FAST_TUNNEL,
    )
    return MeshConfig(**(base | overrides))
