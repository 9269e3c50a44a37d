"""In-process ``MeshService`` nodes for the end-to-end tests: a config for nodes on loopback that
find each other fast, a stand-in ring rank, and a routed stream's merged route facts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from gateway.events import Meta
from gateway.upstream import ModelInfo, StaticDirectory
from mesh.identity import NodeIdentity
from mesh.service import MeshConfig, MeshService
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


async def echo_rank(port: int = 0) -> tuple[asyncio.Server, int]:
    """A stand-in ring rank: a loopback server that echoes what it reads."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", port)
    return server, server.sockets[0].getsockname()[1]


def route_meta(events) -> dict[str, str]:
    """Every ``Meta`` event's headers of a routed stream, merged (later facts win)."""
    out: dict[str, str] = {}
    for e in events:
        if isinstance(e, Meta):
            out |= e.headers
    return out


class MeshNodes:
    """In-process nodes under one tmp dir, started by name and all stopped at the end::

    nodes = MeshNodes(tmp_path); a = await nodes.start("a", {"tiny": upstream}); ...
    await nodes.stop_all()
    """

    def __init__(self, root: Path, **config: Any) -> None:
        self.root = root
        self.config = config
        self.started: list[MeshService] = []

    async def start(
        self, name: str, models: dict[str, Any] | None = None, **overrides: Any
    ) -> MeshService:
        local = StaticDirectory()
        for model, upstream in (models or {}).items():
            local.add(ModelInfo(id=model, context_length=256), upstream)
        home = self.root / name
        config = quick_mesh_config(**(self.config | overrides))
        node = MeshService(home, NodeIdentity.load_or_create(home), local, config)
        await node.start()
        self.started.append(node)
        return node

    async def stop_all(self) -> None:
        for node in reversed(self.started):
            await node.stop()
