"""MeshNode: a :class:`~mesh.node.Node` that takes part in a mesh (what ``mesh up`` runs).

It fills the node's seams: the model directory becomes a :class:`~mesh.directory.MeshDirectory`
(local workers first, then peers), ``model="mesh"`` mixes over that directory, the gateway gets
``/api/status`` and the invite endpoint, and
the :class:`~mesh.service.MeshService` starts *before* the workers load – a bad invite token
fails in a second, not after a model load – and stops with the node.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence
from typing import Any

import httpx

from gateway.upstream import ModelDirectory, ModelInfo, Route, StaticDirectory
from mesh.identity import NodeIdentity
from mesh.mesh_api import mesh_routes
from mesh.node import Node, NodeConfig
from mesh.service import MeshConfig, MeshService

log = logging.getLogger(__name__)


class _LocalModels:
    """The node's local directory; filled once the workers are up (the mesh starts earlier)."""

    def __init__(self) -> None:
        self.inner: ModelDirectory = StaticDirectory()

    def models(self) -> Sequence[ModelInfo]:
        return self.inner.models()

    def routes(self, model: str, session_key: str | None = None) -> list[Route]:
        return self.inner.routes(model, session_key)


class MeshNode(Node):
    def __init__(self, config: NodeConfig, mesh: MeshConfig) -> None:
        super().__init__(config)
        self.identity = NodeIdentity.load_or_create(config.home)
        self.local = _LocalModels()
        self.mesh = MeshService(
            config.home, self.identity, self.local, mesh, load_probe=self._worker_load
        )
        self.on_started.append(self._announce_gateway)

    def build_directory(self) -> ModelDirectory:
        self.local.inner = super().build_directory()
        return self.mesh.directory

    def build_moa(self) -> Any:
        """``model="mesh"`` mixes every model reachable in the MESH, not only local ones."""
        from gateway.moa.upstream import MixtureOfAgents

        return MixtureOfAgents(self.mesh.directory, self.config.moa)

    def extra_routes(self) -> list[Any]:
        return [*super().extra_routes(), *mesh_routes(self.mesh)]

    def status(self) -> dict[str, Any]:
        base = super().status()
        return base | {
            "node_id": self.identity.node_id,
            "mesh_id": self.mesh.mesh_id,
            "peers": len(self.mesh.links),
        }

    async def start_workers(self) -> None:
        self.config.home.mkdir(parents=True, exist_ok=True)
        await self.mesh.start()
        log.info("node %s in mesh %s", self.identity.short_id, self.mesh.mesh_id)
        await super().start_workers()

    async def run(self) -> None:
        try:
            await super().run()
        finally:
            await self.mesh.stop()

    async def _announce_gateway(self, node: Node) -> None:
        self.mesh.config.gateway_url = self.url or ""
        print(
            f"mesh node {self.identity.node_id} on udp port {self.mesh.endpoint.port}", flush=True
        )

    async def _worker_load(self) -> dict[str, Any]:
        """Queue depth, in-flight and tok/s summed over this node's workers (their /health)."""
        total = {"queue_depth": 0, "in_flight": 0, "tok_s": 0.0}
        urls = [w.url for w in self.workers if w.url]
        if not urls:
            return total
        async with httpx.AsyncClient(timeout=1.0) as client:
            for url in urls:
                try:
                    data = (await client.get(f"{url}/health")).json()
                except (httpx.HTTPError, ValueError) as exc:
                    log.debug("worker health at %s failed: %s", url, exc)
                    continue
                total["queue_depth"] += int(data.get("queue_depth", 0))
                total["in_flight"] += int(data.get("in_flight", 0))
                total["tok_s"] += float(data.get("tokens_per_second", 0.0))
        return total


def run_mesh_node(config: NodeConfig, mesh: MeshConfig) -> None:
    """Run a mesh node in this process until SIGINT/SIGTERM (``mesh up``)."""

    async def main() -> None:
        node = MeshNode(config, mesh)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, node.stop)
        await node.run()

    asyncio.run(main())
