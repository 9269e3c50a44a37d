"""Worker processes: one supervised ``python -m worker`` child per model, on loopback.

``WorkerSupervisor`` owns the node's workers: it starts them in parallel, keeps them running and
stops them. Each ``WorkerProcess`` spawns its child, waits until it says it is listening and its
``/health`` answers, and restarts it with exponential backoff on the same port when it dies (so
routes stay valid); on Linux a worker dies with the node even if the node is killed. Every call
to a worker goes through its one :class:`~gateway.worker_client.WorkerClient`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gateway.worker_client import WorkerClient
from mesh.children import child_preexec, forward_output
from mesh.errors import NodeError
from worker.serve.net import SECRET_ENV

log = logging.getLogger(__name__)

STABLE_RUN_S = 30.0  # a worker that ran this long before dying restarts at the base backoff


@dataclass(frozen=True)
class SplitOptions:
    """How a model is split (``mesh up --split N --split-over NODES --share-memory GB``):
    ``ranks`` ranks (0: as few as hold it), on the members that offer the most memory and then
    on this node, or exactly on the nodes ``over`` names (``self``: one more rank here); this
    node's ranks share ``share_memory_bytes`` (0: half the machine's memory); KV cache is
    reserved for ``context_length`` tokens (None: the model's own, at most 32k)."""

    ranks: int = 2
    share_memory_bytes: int = 0
    over: tuple[str, ...] = ()
    context_length: int | None = None
    step_deadline_s: float = 3.0


@dataclass(frozen=True)
class WorkerOptions:
    """How worker children are started and restarted (the node's config builds it)."""

    home: Path
    ready_timeout_s: float = 600.0
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 30.0
    python: str = sys.executable
    # Serve each model split over several rank processes (mesh/split/ranks.py); None: whole.
    split: SplitOptions | None = None
    speculation: str = "auto"  # the worker's --speculation (auto|off)
    draft_model: str | None = None  # the worker's --draft-model
    prompt_cache_gb: float = 2.0  # the worker's --prompt-cache-gb


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

    def __init__(self, model: str, options: WorkerOptions) -> None:
        self.model = model
        self.name = served_name(model)
        self.options = options
        self.url: str | None = None
        self.client: WorkerClient | None = None  # made on the first start; the URL never changes
        # Only this node knows it: another local process cannot use the worker's port to get
        # past the gateway's API key. It travels in the environment, not the command line.
        self.secret = secrets.token_urlsafe(32)
        self.port = 0  # 0 on the first start; the same port afterwards so routes stay valid
        self.restarts = 0
        self.process: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._supervisor: asyncio.Task[None] | None = None
        self._output: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def status(self) -> dict[str, Any]:
        """More for ``mesh status`` (a split model's stages)."""
        return {}

    def _on_output(self, line: str) -> bool:
        """A line of the worker's output meant for the node, not the log (split rank 0's)."""
        return False

    def _command(self) -> list[str]:
        return [
            self.options.python, "-m", "worker",
            "--model", self.model, "--name", self.name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--home", str(self.options.home),
            "--speculation", self.options.speculation,
            "--prompt-cache-gb", f"{self.options.prompt_cache_gb:g}",
            *(("--draft-model", self.options.draft_model) if self.options.draft_model else ()),
        ]  # fmt: skip

    def _env(self) -> dict[str, str]:
        return {**os.environ, SECRET_ENV: self.secret}

    async def _spawn(self) -> str:
        """Start the child and return its URL once it announces it is listening."""
        self.process = process = await asyncio.create_subprocess_exec(
            *self._command(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=self._env(),
            start_new_session=True,  # Ctrl-C reaches the node, which stops the worker in order
            preexec_fn=child_preexec(),
        )
        assert process.stdout is not None
        tail: list[str] = []
        async with asyncio.timeout(self.options.ready_timeout_s):
            while line := (await process.stdout.readline()).decode(errors="replace"):
                if self._on_output(line.rstrip()):
                    continue
                tail = [*tail[-20:], line.rstrip()]
                if line.startswith("worker listening on "):
                    url = line.split()[3]
                    self.port = int(url.rsplit(":", 1)[1])
                    self._output = asyncio.create_task(
                        forward_output(process.stdout, self.name, self._on_output)
                    )
                    if self.client is None:
                        self.client = WorkerClient(url, self.name, secret=self.secret)
                    if not await self.client.wait_ready(lambda: process.returncode is None):
                        raise NodeError(
                            f"worker at {url} exited ({process.returncode}) before it was healthy"
                        )
                    return url
        code = await process.wait()
        raise NodeError(
            f"worker for {self.model!r} exited ({code}) before it was ready:\n" + "\n".join(tail)
        )

    async def start(self) -> str:
        self.url = await self._spawn()
        self._supervisor = asyncio.create_task(self._supervise(), name=f"worker-{self.name}")
        return self.url

    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = self.options.restart_backoff_s
        started = loop.time()
        while not self._stopping:
            assert self.process is not None
            code = await self.process.wait()
            if self._stopping:
                return
            if loop.time() - started > STABLE_RUN_S:  # it ran fine for a while: not a crash loop
                backoff = self.options.restart_backoff_s
            log.warning("worker %s exited with %s; restarting in %.1fs", self.name, code, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.options.restart_backoff_max_s)
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
        if self.client is not None:
            await self.client.aclose()


class ProcessFactory(Protocol):
    """Makes the supervised process that serves ``model`` (a :class:`WorkerProcess`, or one
    that overrides its hooks, such as a split group's rank 0)."""

    def __call__(self, model: str, options: WorkerOptions, /) -> WorkerProcess: ...


class WorkerSupervisor:
    """The node's worker processes, one per model: started together, stopped together."""

    def __init__(self, options: WorkerOptions, models: Sequence[str]) -> None:
        self.options = options
        self.models = list(models)
        self.processes: list[WorkerProcess] = []
        # What makes each model's process: a plain worker here; the node injects split
        # serving's factory (mesh/split/ranks.py), which may split a model over ranks.
        self.make_process: ProcessFactory = WorkerProcess
        # Each model's speculation counters from its worker's last /health (load() polls it):
        # the status picture carries them to the gateway's /metrics.
        self.speculation: dict[str, dict[str, Any]] = {}

    @property
    def clients(self) -> dict[str, WorkerClient]:
        """Each started worker's client, by served name."""
        return {p.name: p.client for p in self.processes if p.client is not None}

    async def start(self) -> None:
        """Start every worker in parallel; one failure cancels the other starts (the caller
        then calls :meth:`stop`). Raises ``NodeError`` in words."""
        for model in self.models:
            check_model_available(self.options.home, model)
            process = self.make_process(model, self.options)
            if any(p.name == process.name for p in self.processes):
                raise NodeError(f"two --model options serve the same name {process.name!r}")
            self.processes.append(process)
        try:
            async with asyncio.TaskGroup() as group:
                for process in self.processes:
                    group.create_task(process.start())
        except* (NodeError, OSError, TimeoutError) as failures:
            first = failures.exceptions[0]
            if isinstance(first, TimeoutError):
                raise NodeError("a worker did not become ready in time") from None
            raise NodeError(str(first)) from None

    async def stop(self) -> None:
        await asyncio.gather(*(p.stop() for p in self.processes))

    def status(self) -> dict[str, Any]:
        """Restarts by worker (not URLs: a worker is this node's private business)."""
        return {
            p.name: {"restarts": p.restarts, **p.status()}
            | ({"speculation": self.speculation[p.name]} if p.name in self.speculation else {})
            for p in self.processes
        }

    def locations(self) -> dict[str, Any]:
        """Where each worker runs, for ``node.json`` (read by this machine's CLI only)."""
        return {p.name: {"url": p.url, "pid": p.pid} for p in self.processes}

    async def load(self) -> dict[str, Any]:
        """Queue depth, in-flight and tok/s summed over the workers' ``/health``, and each
        model's prompt-cache digest (for gossip)."""
        total: dict[str, Any] = {"queue_depth": 0, "in_flight": 0, "tok_s": 0.0, "cache": {}}
        for client in self.clients.values():
            data = await client.health()
            if data is None:
                log.debug("worker %s did not answer its health check", client.model_name)
                continue
            total["queue_depth"] += int(data.get("queue_depth", 0))
            total["in_flight"] += int(data.get("in_flight", 0))
            total["tok_s"] += float(data.get("tokens_per_second", 0.0))
            if isinstance(digest := data.get("cache_digest"), str):
                total["cache"][client.model_name] = digest
            if isinstance(speculation := data.get("speculation"), dict):
                self.speculation[client.model_name] = speculation
        return total
