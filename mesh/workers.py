"""Worker processes: one supervised ``python -m worker`` child per model, on loopback.

``WorkerSupervisor`` owns the node's workers: it starts them in parallel, keeps them running and
stops them. Each ``WorkerProcess`` spawns its child, waits until it says it is listening and its
``/health`` answers, and restarts it with exponential backoff on the same port when it dies (so
routes stay valid); on Linux a worker dies with the node even if the node is killed. While it
runs, its ``/health`` is checked every few seconds (``mesh/worker_health.py``): a worker that
misses enough checks in a row is stuck, and is withdrawn, killed and restarted. Only a serving
worker's model has a route: the node is told of every change (``on_listing``). Every call to a
worker goes through its one :class:`~gateway.worker_client.WorkerClient`, with deadlines.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import secrets
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gateway.deadlines import StreamDeadlines
from gateway.worker_client import WorkerClient
from mesh.cache_stats import summarise
from mesh.children import child_preexec, forward_output
from mesh.errors import NodeError
from mesh.worker_health import Health, HealthCheck, HealthOptions
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
    prompt_cache_disk_gb: float | None = (
        None  # the worker's --prompt-cache-disk-gb (None: its default)
    )
    memory_gb: float | None = None  # the worker's --memory-gb (None: its default)
    # The node's checks of each running worker, and the deadlines on every worker stream.
    health: HealthOptions = field(default_factory=HealthOptions)
    deadlines: StreamDeadlines = field(default_factory=StreamDeadlines)


class WorkerState(enum.Enum):
    """A supervised worker's life. Only a serving worker's model has a route; in every other
    state its model stays listed on this node (a request for it is 503 with Retry-After) and
    is not advertised to peers."""

    STARTING = "starting"  # loading (a split model: forming its group or waiting for memory)
    SERVING = "serving"
    STUCK = "stuck"  # missed its health checks: withdrawn, being killed
    RESTARTING = "restarting"  # exited: withdrawn until it is back


# Told of each change of a worker's state: True when it serves (list its route), else False.
Listing = Callable[["WorkerProcess", bool], Awaitable[None]]


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
        self.state = WorkerState.STARTING
        self.health: HealthCheck | None = None  # the running worker's checks
        self.on_listing: Listing | None = None  # set by the supervisor (the node's directory)
        self.process: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._supervisor: asyncio.Task[None] | None = None
        self._output: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def answering(self) -> bool:
        """Whether it answered its last health check (or has not been checked yet)."""
        if self.state is WorkerState.STUCK:
            return False
        return self.health is None or self.health.state is Health.HEALTHY

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
            *_sized("--prompt-cache-disk-gb", self.options.prompt_cache_disk_gb),
            *_sized("--memory-gb", self.options.memory_gb),
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
                        self.client = WorkerClient(
                            url, self.name, secret=self.secret, deadlines=self.options.deadlines
                        )
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
        await self._set_state(WorkerState.SERVING)
        self._supervisor = asyncio.create_task(self._supervise(), name=f"worker-{self.name}")
        return self.url

    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = self.options.restart_backoff_s
        started = loop.time()
        while not self._stopping:
            assert self.process is not None
            code = await self._wait_while_healthy(self.process)
            if self._stopping:
                return
            await self._set_state(WorkerState.RESTARTING)
            if loop.time() - started > STABLE_RUN_S:  # it ran fine for a while: not a crash loop
                backoff = self.options.restart_backoff_s
            log.warning("worker %s exited with %s; restarting in %.1fs", self.name, code, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.options.restart_backoff_max_s)
            started = loop.time()
            try:
                self.url = await self._spawn()
                self.restarts += 1
                await self._set_state(WorkerState.SERVING)
            except (NodeError, OSError, TimeoutError) as exc:
                log.error("worker %s failed to restart: %s", self.name, exc)
                if self.process is not None and self.process.returncode is None:
                    self.process.kill()  # hung while loading: do not wait on it forever

    async def _wait_while_healthy(self, process: asyncio.subprocess.Process) -> int:
        """Until ``process`` exits (its exit status), checking its health meanwhile; a stuck one
        is withdrawn and killed, so it exits soon."""
        checks = asyncio.create_task(self._check_health(process), name=f"health-{self.name}")
        try:
            return await process.wait()
        finally:
            checks.cancel()
            await asyncio.wait([checks])

    async def _check_health(self, process: asyncio.subprocess.Process) -> None:
        """Ask ``/health`` every interval until the worker is stuck (mesh/worker_health.py),
        then withdraw its model and SIGKILL it: its open requests fail over (nothing sent to
        their client yet) or end with an error event, and the restart loop brings it back."""
        options = self.options.health
        client = self.client
        if options.interval_s <= 0 or client is None:
            return
        loop = asyncio.get_running_loop()
        self.health = check = HealthCheck(self.name, options, loop.time())
        while check.state is not Health.STUCK:
            asked = loop.time()
            body = await client.health(timeout_s=options.interval_s)
            if body is None:
                check.no_answer(loop.time())
            else:
                check.answered(loop.time(), body)
            await asyncio.sleep(max(0.0, asked + options.interval_s - loop.time()))
        log.error(
            "worker %s is stuck (%s): withdrawn and killed; it restarts", self.name, check.why
        )
        await self._set_state(WorkerState.STUCK)
        if process.returncode is None:
            process.kill()  # SIGKILL: a stopped (SIGSTOP) process would never see a SIGTERM

    async def _set_state(self, state: WorkerState) -> None:
        """Change state (logged) and tell the node whether the model has a route now."""
        if state is self.state:
            return
        # One message per target state: the node's log filter holds back repeats of a message.
        log.info("worker %s: %s -> " + state.value, self.name, self.state.value)
        self.state = state
        await self._listing(state is WorkerState.SERVING)

    async def _listing(self, serving: bool) -> None:
        if self.on_listing is None:
            return
        try:
            await self.on_listing(self, serving)
        except Exception:  # a listing failure must not stop the supervision; say so
            log.exception("could not update the listing of %s", self.name)

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
        # Told whenever a worker starts or stops serving (the node's directory lists it).
        self.on_listing: Listing | None = None
        # Each model's speculation counters from its worker's last /health (load() polls it):
        # the status picture carries them to the gateway's /metrics.
        self.speculation: dict[str, dict[str, Any]] = {}
        # And its memory budget and prompt-cache tiers (sizes and counters), for /health.
        self.memory: dict[str, dict[str, Any]] = {}

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
            process.on_listing = self.on_listing
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
        """State, restarts and health checks by worker (not URLs: a worker is this node's
        private business)."""
        now = time.monotonic()  # the event loop's clock, which the checks were fed
        return {
            p.name: {"state": p.state.value, "restarts": p.restarts, **p.status()}
            | ({"health": p.health.status(now)} if p.health is not None else {})
            | ({"speculation": self.speculation[p.name]} if p.name in self.speculation else {})
            | self.memory.get(p.name, {})
            for p in self.processes
        }

    def locations(self) -> dict[str, Any]:
        """Where each worker runs, for ``node.json`` (read by this machine's CLI only)."""
        return {p.name: {"url": p.url, "pid": p.pid} for p in self.processes}

    async def load(self) -> dict[str, Any]:
        """Queue depth, in-flight and tok/s summed over the workers' ``/health``, and each
        model's prompt-cache digest and summary (for gossip)."""
        total: dict[str, Any] = {
            "queue_depth": 0, "in_flight": 0, "tok_s": 0.0, "cache": {}, "cache_stats": {}
        }  # fmt: skip
        for process in self.processes:
            client = process.client
            if client is None or not process.answering:
                continue  # a stuck one would hold up every other's load for its timeout
            data = await client.health()
            if data is None:
                log.debug("worker %s did not answer its health check", client.model_name)
                continue
            total["queue_depth"] += int(data.get("queue_depth", 0))
            total["in_flight"] += int(data.get("in_flight", 0))
            total["tok_s"] += float(data.get("tokens_per_second", 0.0))
            if isinstance(digest := data.get("cache_digest"), str):
                total["cache"][client.model_name] = digest
            if (stats := summarise(data)) is not None:
                total["cache_stats"][client.model_name] = stats
            if isinstance(speculation := data.get("speculation"), dict):
                self.speculation[client.model_name] = speculation
            self.memory[client.model_name] = {
                key: data[key] for key in _MEMORY_KEYS if isinstance(data.get(key), dict)
            }
        return total


# The blocks of a worker's /health its node's /health repeats under ``workers.<model>``: the
# memory budget (limit, use, weights) and the prompt cache's memory and disk tiers (sizes,
# evictions, disk writes and loads) – what the lab's memory scenario reads.
_MEMORY_KEYS = ("memory", "prompt_cache", "prompt_cache_disk")


def _sized(flag: str, gb: float | None) -> tuple[str, ...]:
    """``flag GB`` for the worker's command line, or nothing for the worker's own default."""
    return () if gb is None else (flag, f"{gb:g}")
