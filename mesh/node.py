"""A node: worker processes, the gateway on uvicorn, the mesh service, and ``node.json``.

``Node`` is composed, not inherited: a :class:`~mesh.workers.WorkerSupervisor` owns the worker
processes (every call to a worker goes through its ``WorkerClient``), a
:class:`~mesh.service.MeshService` runs membership, tunnels, gossip and discovery, and the gateway
app receives the mesh's model directory, the mixture-of-agents upstream, the invite route and one
status source. ``Node.run()`` starts them in order, serves until ``stop()`` (SIGINT/SIGTERM in
``mesh up``), records the node in ``<home>/node.json`` (for ``mesh chat`` and friends) and shuts
down in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.console import close_event_streams
from gateway.deadlines import StreamDeadlines
from gateway.moa.config import MoaConfig
from gateway.moa.upstream import MixtureOfAgents
from gateway.responses.state import LocalResponses
from gateway.responses.store import ResponseStore
from gateway.upstream import StaticDirectory
from mesh.addresses import LOOPBACK_HOSTS
from mesh.errors import NodeError
from mesh.files import make_home
from mesh.http import mesh_routes
from mesh.identity import NodeIdentity
from mesh.node_file import remove_node_file, write_node_file
from mesh.response_relay import MeshResponses, node_tag
from mesh.service import MeshConfig, MeshService
from mesh.split.ranks import SplitProcesses
from mesh.worker_health import HealthOptions
from mesh.workers import SplitOptions, WorkerOptions, WorkerProcess, WorkerState, WorkerSupervisor
from worker.serve.net import bind_socket, server_limits

log = logging.getLogger(__name__)

MIN_KEY_LENGTH = 16  # off loopback: a key someone on the LAN cannot guess in an afternoon


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
    split: SplitOptions | None = None  # mesh up --split N: every model over N local ranks
    speculation: str = "auto"  # the workers' --speculation
    draft_model: str | None = None  # the workers' --draft-model (a resolved path or hub id)
    prompt_cache_gb: float = 2.0  # the workers' --prompt-cache-gb
    prompt_cache_disk_gb: float | None = None  # the workers' --prompt-cache-disk-gb
    memory_gb: float | None = None  # the workers' --memory-gb
    # mesh up --worker-health-*, --worker-stall-timeout; --first-token/idle-token-timeout
    health: HealthOptions = field(default_factory=HealthOptions)
    deadlines: StreamDeadlines = field(default_factory=StreamDeadlines)

    def worker_options(self) -> WorkerOptions:
        return WorkerOptions(
            home=self.home,
            ready_timeout_s=self.worker_ready_timeout_s,
            restart_backoff_s=self.restart_backoff_s,
            restart_backoff_max_s=self.restart_backoff_max_s,
            python=self.python,
            split=self.split,
            speculation=self.speculation,
            draft_model=self.draft_model,
            prompt_cache_gb=self.prompt_cache_gb,
            prompt_cache_disk_gb=self.prompt_cache_disk_gb,
            memory_gb=self.memory_gb,
            health=self.health,
            deadlines=self.deadlines,
        )

    def check(self) -> None:
        """Refuse unsafe or impossible settings before anything starts."""
        key = self.gateway.api_key
        if key is not None and not key.strip():
            raise NodeError("the API key is empty or only whitespace")
        if self.host not in LOOPBACK_HOSTS and not key:
            raise NodeError(
                f"binding {self.host} exposes the node beyond this machine: set an API key (--api-key)"
            )
        if self.host not in LOOPBACK_HOSTS and len(key.strip()) < MIN_KEY_LENGTH:  # type: ignore[union-attr]
            raise NodeError(
                f"binding {self.host} needs an API key of at least {MIN_KEY_LENGTH} characters"
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


class Node:
    """One node, composed: worker processes, the mesh service, the gateway app on uvicorn.

    The mesh starts *before* the workers load, so a bad invite token fails in a second, not
    after a model load. The model directory covers local workers first, then peers; ``model=
    "mesh"`` mixes every model reachable in the mesh.
    """

    def __init__(self, config: NodeConfig, mesh: MeshConfig | None = None) -> None:
        config.check()
        self.config = config
        make_home(config.home)
        self.identity = NodeIdentity.load_or_create(config.home)
        models = config.models if config.start_workers else ()
        self.workers = WorkerSupervisor(config.worker_options(), models)
        self.local = StaticDirectory()  # filled once the workers are up
        gateway = config.gateway
        store = ResponseStore(
            gateway.response_store or config.home / "responses.sqlite3",
            max_responses=gateway.response_store_max,
            max_bytes=gateway.response_store_max_bytes,
        )
        store.fail_unfinished("the node restarted while this background response ran")
        self.stored_responses = LocalResponses(store, node_tag(self.identity.node_id))
        self.mesh = MeshService(
            config.home,
            self.identity,
            self.local,
            mesh,
            load_probe=self.workers.load,
            responses=self.stored_responses,
        )
        self.workers.make_process = SplitProcesses(self.mesh.split)
        self.workers.on_listing = self._list
        self.responses = MeshResponses(
            self.stored_responses,
            links=lambda: self.mesh.links,
            members=lambda: set(self.mesh.members.members),
        )
        self.url: str | None = None
        self.csrf_token = secrets.token_urlsafe(24)  # for admin POSTs; in the 0600 node.json
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def _list(self, process: WorkerProcess, serving: bool) -> None:
        """A model has its route while its worker serves. Otherwise (a stuck worker restarting,
        a split group broken, re-forming or waiting for memory) it stays listed here without a
        route, so a request for it is 503 with Retry-After, and gossip stops advertising it."""
        if serving and process.client is not None:
            info = await process.client.describe()
            if process.state is not WorkerState.SERVING:
                return  # it stopped serving while it described itself: withdrawn already
            self.local.remove(process.name)
            self.local.add(info, process.client)
        else:
            self.local.withdraw(process.name)

    def status(self) -> dict[str, Any]:
        """The status picture (``gateway.status``): the mesh's, plus this node's workers."""
        return self.mesh.status() | {"workers": self.workers.status()}

    def build_app(self) -> Starlette:
        directory = self.mesh.directory
        return create_app(
            directory,
            self.config.gateway,
            moa=MixtureOfAgents(directory, self.config.moa, record=self.mesh.track_record),
            extra_routes=mesh_routes(
                self.mesh, api_key=self.config.gateway.api_key, csrf_token=self.csrf_token
            ),
            status=self.status,
            responses=self.responses,
        )

    async def run(self) -> None:
        """Start everything, serve until :meth:`stop`, then shut down in order."""
        try:
            with _starting_status(self.workers.models):
                await self.mesh.start()
                log.info("node %s in mesh %s", self.identity.short_id, self.mesh.mesh_id)
                await self.workers.start()
            for process in self.workers.processes:
                if process.state is not WorkerState.SERVING:  # a split model still forming
                    self.local.withdraw(process.name)
            await self._serve(self.build_app())
        finally:
            await self.workers.stop()
            remove_node_file(self.config.home)
            await self.mesh.stop()
            self.stored_responses.store.close()

    async def _serve(self, app: Starlette) -> None:
        sock = _bind(self.config.host, self.config.port)
        port = sock.getsockname()[1]
        host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
        self.url = f"http://{host}:{port}"
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=5,
            **server_limits(),
        )
        server = _NodeServer(config)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        ready = asyncio.create_task(server.ready.wait())
        await asyncio.wait([serving, ready], return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            await serving  # raises the startup failure
            raise NodeError("the gateway stopped while starting")
        self._write_node_file(port)
        models = ", ".join(self.workers.clients) or "none"
        print(f"mlx-mesh gateway on {self.url}  (models: {models})", flush=True)
        self.mesh.config.gateway_url = self.url
        print(
            f"mesh node {self.identity.node_id} on udp port {self.mesh.endpoint.port}", flush=True
        )
        if self.mesh.copy.port is not None:
            print(f"peer copy on tcp port {self.mesh.copy.port} (tls, members only)", flush=True)
        await self._stop.wait()
        close_event_streams(app)  # open consoles would otherwise hold up the shutdown
        server.should_exit = True
        await serving

    def _write_node_file(self, port: int) -> None:
        info: dict[str, Any] = {
            "url": self.url,
            "pid": os.getpid(),
            "host": self.config.host,
            "port": port,
            "workers": self.workers.locations(),
            "models": list(self.workers.clients),
            "csrf": self.csrf_token,
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


def run_mesh_node(config: NodeConfig, mesh: MeshConfig) -> None:
    """Run a node in this process until SIGINT/SIGTERM (``mesh up``)."""

    async def main() -> None:
        node = Node(config, mesh)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, node.stop)
        await node.run()

    asyncio.run(main())
