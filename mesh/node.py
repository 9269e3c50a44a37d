"""A node: worker processes, the gateway on uvicorn, the mesh service, and ``node.json``.

``Node.run()`` starts one worker per model (``mesh.workers``), builds the model directory and the
gateway app, serves it, records the node in ``<home>/node.json`` (for ``mesh chat`` and friends)
and runs until ``stop()`` (SIGINT/SIGTERM in ``mesh up``). ``MeshNode`` is the node that takes
part in a mesh (what ``mesh up`` runs): its model directory covers local workers first, then
peers; ``model="mesh"`` mixes over that directory; the gateway gets ``/api/status`` and the invite
endpoint; the :class:`~mesh.service.MeshService` starts *before* the workers load – a bad invite
token fails in a second, not after a model load – and stops with the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.console import close_event_streams
from gateway.moa.config import MoaConfig
from gateway.upstream import ModelDirectory, ModelInfo, Route, StaticDirectory
from gateway.worker_client import WorkerUpstream
from mesh.errors import NodeError
from mesh.http import mesh_routes
from mesh.identity import NodeIdentity
from mesh.node_file import remove_node_file, write_node_file
from mesh.service import MeshConfig, MeshService
from mesh.workers import WorkerOptions, WorkerProcess, check_model_available
from worker.net import bind_socket

log = logging.getLogger(__name__)

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass(frozen=True)
class NodeConfig:
    home: Path
    models: Sequence[str] = ()
    host: str = "127.0.0.1"
    port: int = 9337
    start_workers: bool = True
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    moa: MoaConfig = field(default_factory=MoaConfig)
    worker_ready_timeout_s: float = 600.0
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 30.0
    python: str = sys.executable

    def worker_options(self) -> WorkerOptions:
        return WorkerOptions(
            home=self.home,
            ready_timeout_s=self.worker_ready_timeout_s,
            restart_backoff_s=self.restart_backoff_s,
            restart_backoff_max_s=self.restart_backoff_max_s,
            python=self.python,
        )

    def check(self) -> None:
        """Refuse unsafe or impossible settings before anything starts."""
        if self.host not in LOOPBACK and not self.gateway.api_key:
            raise NodeError(
                f"binding {self.host} exposes the node beyond this machine: set an API key (--api-key)"
            )
        if self.start_workers and not self.models:
            raise NodeError("no model to serve: pass --model NAME (or --no-worker)")


@contextlib.contextmanager
def _starting_status(models: Sequence[str]) -> Iterator[None]:
    """A spinner while workers load and the mesh joins (seconds to minutes), on a terminal only:
    logs and pipes get the one ready line instead."""
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        yield
        return
    what = f"loading {', '.join(models)}" if models else "starting"
    with console.status(f"{what} and joining the mesh…"):
        yield


async def _model_info(upstream: WorkerUpstream) -> ModelInfo:
    """The worker's own description of its model (context length, size), for /v1/models."""
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            data = (await client.get(f"{upstream.base_url}/v1/models")).json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        log.warning("worker %s did not describe its model: %s", upstream.model_name, exc)
        return ModelInfo(id=upstream.model_name)
    return ModelInfo(
        id=upstream.model_name,
        architecture=str(data.get("architecture") or "unknown"),
        parameters=data.get("parameters"),
        context_length=data.get("context_length"),
    )


class Node:
    def __init__(self, config: NodeConfig) -> None:
        config.check()
        self.config = config
        self.workers: list[WorkerProcess] = []
        self.upstreams: dict[str, WorkerUpstream] = {}
        self.model_infos: dict[str, ModelInfo] = {}
        self.url: str | None = None
        self.on_started: list[Callable[[Node], Awaitable[None]]] = []
        self._stop = asyncio.Event()
        self._server: Any = None

    # -- seams for the mesh layer ---------------------------------------------------------------

    def build_directory(self) -> ModelDirectory:
        """This node's models → local worker upstreams. Mesh wraps this with its peer table."""
        directory = StaticDirectory()
        for name, upstream in self.upstreams.items():
            directory.add(self.model_infos.get(name, ModelInfo(id=name)), upstream)
        return directory

    def build_moa(self) -> Any:
        return None

    def extra_routes(self) -> list[Any]:
        return []

    def status(self) -> dict[str, Any]:
        """The status picture (``gateway.status``): workers by name, with their restarts (not
        their URLs: a worker is this node's private business)."""
        return {"workers": {w.name: {"restarts": w.restarts} for w in self.workers}}

    # -- lifecycle ------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    async def start_workers(self) -> None:
        if not self.config.start_workers:
            return
        for model in self.config.models:
            check_model_available(self.config.home, model)
            worker = WorkerProcess(model, self.config.worker_options())
            if any(w.name == worker.name for w in self.workers):
                raise NodeError(f"two --model options serve the same name {worker.name!r}")
            self.workers.append(worker)
        try:  # in parallel; one failure cancels the other starts (run() then stops them all)
            async with asyncio.TaskGroup() as group:
                for worker in self.workers:
                    group.create_task(worker.start())
        except* (NodeError, OSError, TimeoutError) as failures:
            first = failures.exceptions[0]
            if isinstance(first, TimeoutError):
                raise NodeError("a worker did not become ready in time") from None
            raise NodeError(str(first)) from None
        for worker in self.workers:
            assert worker.url is not None
            upstream = WorkerUpstream(worker.url, worker.name)  # restarts keep the port
            self.upstreams[worker.name] = upstream
            self.model_infos[worker.name] = await _model_info(upstream)

    async def run(self) -> None:
        """Start everything, serve until :meth:`stop`, then shut down in order."""
        self.config.home.mkdir(parents=True, exist_ok=True)
        try:
            with _starting_status(self.config.models if self.config.start_workers else ()):
                await self.start_workers()
            app = create_app(
                self.build_directory(),
                self.config.gateway,
                moa=self.build_moa(),
                extra_routes=self.extra_routes(),
                status=self.status,
            )
            sock = _bind(self.config.host, self.config.port)
            port = sock.getsockname()[1]
            host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
            self.url = f"http://{host}:{port}"
            config = uvicorn.Config(
                app, log_level="warning", access_log=False, timeout_graceful_shutdown=5
            )
            server = _NodeServer(config)
            self._server = server
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            ready = asyncio.create_task(server.ready.wait())
            await asyncio.wait([serving, ready], return_when=asyncio.FIRST_COMPLETED)
            if not ready.done():
                ready.cancel()
                await serving  # raises the startup failure
                raise NodeError("the gateway stopped while starting")
            self._write_node_file(port)
            print(
                f"mlx-mesh gateway on {self.url}  (models: {', '.join(self.upstreams) or 'none'})",
                flush=True,
            )
            for hook in self.on_started:
                await hook(self)
            await self._stop.wait()
            close_event_streams(app)  # open consoles would otherwise hold up the shutdown
            server.should_exit = True
            await serving
        finally:
            await asyncio.gather(*(w.stop() for w in self.workers))
            for upstream in self.upstreams.values():
                await upstream.aclose()
            remove_node_file(self.config.home)

    def _write_node_file(self, port: int) -> None:
        info = {
            "url": self.url,
            "pid": os.getpid(),
            "host": self.config.host,
            "port": port,
            "workers": {w.name: {"url": w.url, "pid": w.pid} for w in self.workers},
            "models": list(self.upstreams),
        }
        if self.config.gateway.api_key:
            info["api_key"] = self.config.gateway.api_key
        write_node_file(self.config.home, info)


def _bind(host: str, port: int) -> socket.socket:
    # It asks for IPPROTO_TCP so asyncio sets TCP_NODELAY (without it a
    # kept-alive client waits ~40 ms per request on delayed ACKs).
    try:
        return bind_socket(host, port)
    except OSError as exc:
        raise NodeError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc


class _NodeServer(uvicorn.Server):
    """uvicorn without its own signal handling (the node owns SIGINT/SIGTERM), and with a
    ``ready`` event set once it listens."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.ready.set()


def run_node(config: NodeConfig) -> None:
    """Run a node in this process until SIGINT/SIGTERM (what ``mesh up`` calls)."""

    async def main() -> None:
        node = Node(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, node.stop)
        await node.run()

    asyncio.run(main())


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
        return [
            *super().extra_routes(),
            *mesh_routes(self.mesh, api_key=self.config.gateway.api_key),
        ]

    def status(self) -> dict[str, Any]:
        return super().status() | self.mesh.status()

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
