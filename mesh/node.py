"""A node: the supervised worker child processes, the gateway on uvicorn, and ``node.json``.

``Node.run()`` starts one worker per model (``python -m worker``), waits until each says it is
listening, builds the model directory and the gateway app, serves it, records the node in
``<home>/node.json`` (for ``mesh chat`` and friends) and runs until ``stop()`` (SIGINT/SIGTERM
in ``mesh up``). Workers that die are restarted with exponential backoff; on shutdown they are
terminated (and on Linux they die with the node even if it is killed).

Seams for the mesh layer: override or replace :meth:`Node.build_directory` (peer-aware
directory), :meth:`Node.build_moa`, :meth:`Node.extra_routes` and :meth:`Node.status`;
``on_started`` hooks run once the gateway is listening (start tunnels, gossip, discovery there).
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
import orjson
import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.console import close_event_streams
from gateway.moa.config import MoaConfig
from gateway.upstream import ModelDirectory, ModelInfo, StaticDirectory
from gateway.worker_client import WorkerUpstream
from worker.net import bind_socket

log = logging.getLogger(__name__)

NODE_FILE = "node.json"
STABLE_RUN_S = 30.0  # a worker that ran this long before dying restarts at the base backoff
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class NodeError(Exception):
    """The node cannot start: a bad configuration or a worker that never came up."""


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

    def check(self) -> None:
        """Refuse unsafe or impossible settings before anything starts."""
        if self.host not in LOOPBACK and not self.gateway.api_key:
            raise NodeError(
                f"binding {self.host} exposes the node beyond this machine: set an API key (--api-key)"
            )
        if self.start_workers and not self.models:
            raise NodeError("no model to serve: pass --model NAME (or --no-worker)")


def check_model_available(home: Path, model: str) -> None:
    """Fail early, in words, for a store name that was never pulled (hub ids pass through)."""
    from worker import store

    resolved = store.resolve_model(home, model)
    if resolved == model and "/" not in model and not Path(model).expanduser().is_dir():
        if model in store.REGISTRY:
            raise NodeError(
                f"model {model!r} is not in {store.models_dir(home)}; pull it first: mesh models pull {model}"
            )
        known = ", ".join(sorted(store.REGISTRY))
        raise NodeError(
            f"model {model!r} is not in {store.models_dir(home)}, not a directory and not a known "
            f"model ({known}); convert a GGUF with `mesh models convert` or pass an MLX directory"
        )


def served_name(model: str) -> str:
    """The name a model is served under: a directory's name, else the store name itself."""
    path = Path(model).expanduser()
    return path.name if path.is_dir() else model


class WorkerProcess:
    """One supervised ``python -m worker`` child serving one model on loopback."""

    def __init__(self, model: str, config: NodeConfig) -> None:
        self.model = model
        self.name = served_name(model)
        self.config = config
        self.url: str | None = None
        self.port = 0  # 0 on the first start; the same port afterwards so routes stay valid
        self.restarts = 0
        self.process: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._supervisor: asyncio.Task[None] | None = None
        self._output: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def _command(self) -> list[str]:
        return [
            self.config.python, "-m", "worker",
            "--model", self.model, "--name", self.name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--home", str(self.config.home),
        ]  # fmt: skip

    async def _spawn(self) -> str:
        """Start the child and return its URL once it announces it is listening."""
        self.process = await asyncio.create_subprocess_exec(
            *self._command(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the node, which stops the worker in order
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        assert self.process.stdout is not None
        tail: list[str] = []
        async with asyncio.timeout(self.config.worker_ready_timeout_s):
            while line := (await self.process.stdout.readline()).decode(errors="replace"):
                tail = [*tail[-20:], line.rstrip()]
                if line.startswith("worker listening on "):
                    url = line.split()[3]
                    self.port = int(url.rsplit(":", 1)[1])
                    self._output = asyncio.create_task(_forward(self.process.stdout, self.name))
                    await _wait_healthy(url, self.process)
                    return url
        code = await self.process.wait()
        raise NodeError(
            f"worker for {self.model!r} exited ({code}) before it was ready:\n" + "\n".join(tail)
        )

    async def start(self) -> str:
        self.url = await self._spawn()
        self._supervisor = asyncio.create_task(self._supervise(), name=f"worker-{self.name}")
        return self.url

    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = self.config.restart_backoff_s
        started = loop.time()
        while not self._stopping:
            assert self.process is not None
            code = await self.process.wait()
            if self._stopping:
                return
            if loop.time() - started > STABLE_RUN_S:  # it ran fine for a while: not a crash loop
                backoff = self.config.restart_backoff_s
            log.warning("worker %s exited with %s; restarting in %.1fs", self.name, code, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.config.restart_backoff_max_s)
            started = loop.time()
            try:
                self.url = await self._spawn()
                self.restarts += 1
            except (NodeError, OSError, TimeoutError) as exc:
                log.error("worker %s failed to restart: %s", self.name, exc)
                if self.process is not None and self.process.returncode is None:
                    self.process.kill()  # hung while loading: do not wait on it forever

    async def stop(self, grace_s: float = 5.0) -> None:
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.wait([self._supervisor])
        process = self.process
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                async with asyncio.timeout(grace_s):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()
        if self._output is not None:
            self._output.cancel()
            await asyncio.wait([self._output])


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


def _die_with_parent() -> None:
    """Linux: the worker gets SIGTERM if the node dies, even by SIGKILL (no orphans)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


async def _wait_healthy(url: str, process: asyncio.subprocess.Process) -> None:
    """Until the worker's /health answers 200 (it announces itself just before serving)."""
    async with httpx.AsyncClient(timeout=2.0) as client:
        while process.returncode is None:
            try:
                if (await client.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not accepting yet: poll again
            await asyncio.sleep(0.05)
    raise NodeError(f"worker at {url} exited ({process.returncode}) before it was healthy")


async def _forward(stream: asyncio.StreamReader, name: str) -> None:
    while line := await stream.readline():
        log.info("[worker %s] %s", name, line.decode(errors="replace").rstrip())


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
        return {"workers": {w.name: {"url": w.url, "restarts": w.restarts} for w in self.workers}}

    # -- lifecycle ------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    async def start_workers(self) -> None:
        if not self.config.start_workers:
            return
        for model in self.config.models:
            check_model_available(self.config.home, model)
            worker = WorkerProcess(model, self.config)
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
                status_provider=self.status,
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
            with contextlib.suppress(FileNotFoundError):
                (self.config.home / NODE_FILE).unlink()

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
        path = self.config.home / NODE_FILE
        partial = path.with_suffix(".json.tmp")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # may hold the API key
        with os.fdopen(fd, "wb") as fh:
            fh.write(orjson.dumps(info, option=orjson.OPT_INDENT_2))
        partial.replace(path)  # readers never see a half-written file


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
