"""A split model's rank processes on this node, supervised as one worker.

:class:`SplitWorkerProcess` is a :class:`~mesh.workers.WorkerProcess` whose child is rank 0 of
a pipeline split (``python -m worker.split_rank --serve``: the normal worker HTTP API, so the
gateway sees one more worker) and which starts the other ranks beside it. The mesh sets every
rank's ``MLX_RANK`` and ``MLX_HOSTFILE`` (fresh loopback ports for each forming of the group;
no ``mlx.launch``, no SSH). The group lives and dies as one: rank 0 exits when a peer is gone
or a step misses its deadline (worker/split_rank.py), a follower that exits takes rank 0 down
with it, and the worker's restart loop then re-forms the whole group.

Only ranks on this node so far (``mesh up --split N``, for tests and for the benchmark): the
plan, the rank processes and their liveness are the real ones; starting ranks on other members
and bridging their ring sockets over an authenticated channel are not built yet.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from pathlib import Path

from mesh.errors import NodeError, PlanError
from mesh.split.plan import Offer, SplitPlan, plan_split
from mesh.workers import WorkerOptions, WorkerProcess, _die_with_parent, _forward

log = logging.getLogger(__name__)

FOLLOWER_GRACE_S = 2.0  # rank 0 exits by itself this soon after a follower went (BROKEN_GRACE_S)
MAX_CONTEXT = 32768  # KV reserved by default: a long-context model's full window rarely fits


class SplitWorkerProcess(WorkerProcess):
    """Rank 0 (the served worker) plus ranks 1…n-1 of one model, on this node."""

    def __init__(self, model: str, options: WorkerOptions) -> None:
        super().__init__(model, options)
        assert options.split is not None
        from worker import store

        self.path = store.resolve_model(options.home, model)
        self.plan = make_local_plan(self.name, Path(self.path), options)
        self.followers: list[asyncio.subprocess.Process] = []
        self._follower_output: list[asyncio.Task[None]] = []
        self._hostfile = options.home / "run" / f"split-{self.name}.json"
        self._watch: asyncio.Task[None] | None = None

    def _split_arg(self) -> str:
        return ",".join(str(n) for n in self.plan.layer_split())

    def _command(self) -> list[str]:
        assert self.options.split is not None
        return [
            self.options.python, "-m", "worker.split_rank", "--serve",
            "--model", self.path, "--name", self.name, "--split", self._split_arg(),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--step-deadline-s", str(self.options.split.step_deadline_s),
        ]  # fmt: skip

    def _env(self) -> dict[str, str]:
        return {**super()._env(), "MLX_RANK": "0", "MLX_HOSTFILE": str(self._hostfile)}

    async def _spawn(self) -> str:
        """(Re-)form the group: new ring ports, the followers, then rank 0 (which announces
        the URL once the group formed and the model slice loaded)."""
        await self._stop_followers()
        self._write_hostfile()
        command = [
            self.options.python, "-m", "worker.split_rank",
            "--model", self.path, "--split", self._split_arg(),
        ]  # fmt: skip
        for rank in range(1, self.plan.ranks):
            env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(self._hostfile)}
            follower = await asyncio.create_subprocess_exec(
                *command,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent if os.uname().sysname == "Linux" else None,
            )
            assert follower.stdout is not None
            self._follower_output.append(
                asyncio.create_task(_forward(follower.stdout, f"{self.name} rank {rank}"))
            )
            self.followers.append(follower)
        url = await super()._spawn()
        self._watch = asyncio.create_task(self._watch_followers(), name=f"split-{self.name}")
        return url

    async def _watch_followers(self) -> None:
        """A follower that exits breaks the group: rank 0 notices on its next step and exits;
        if it has not within the grace (idle, or wedged), it is killed, and the restart loop
        re-forms the group."""
        waits = [asyncio.create_task(f.wait()) for f in self.followers]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if self._stopping:
            return
        log.warning("a rank of split model %s exited; re-forming the group", self.name)
        process = self.process
        if process is None or process.returncode is not None:
            return
        try:
            async with asyncio.timeout(FOLLOWER_GRACE_S):
                await process.wait()
        except TimeoutError:
            process.kill()

    def _write_hostfile(self) -> None:
        """Every rank's ring address: loopback only, fresh free ports."""
        ports = free_ports(self.plan.ranks)
        self._hostfile.parent.mkdir(parents=True, exist_ok=True)
        self._hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))

    async def _stop_followers(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.wait([self._watch])
            self._watch = None
        for follower in self.followers:
            if follower.returncode is None:
                follower.kill()  # SIGKILL: also ends a stopped (SIGSTOP) rank
                await follower.wait()
        self.followers = []
        for task in self._follower_output:
            task.cancel()
        if self._follower_output:
            await asyncio.wait(self._follower_output)
        self._follower_output = []

    async def stop(self, grace_s: float = 5.0) -> None:
        await super().stop(grace_s)
        await self._stop_followers()


def make_local_plan(name: str, path: Path, options: WorkerOptions) -> SplitPlan:
    """The plan over this node's ranks (each offered an equal part of the shared memory);
    printed before the ranks start. A model that does not fit is a ``NodeError`` sentence."""
    from worker.layout import LayoutError, read_layout

    split = options.split
    assert split is not None
    try:
        layout = read_layout(path)
    except LayoutError as exc:
        raise NodeError(f"cannot split {name}: {exc}") from None
    offered = split.share_memory_bytes or _physical_memory() // 2
    offers = [
        Offer(f"rank{i}", offered // split.ranks, f"local rank {i}") for i in range(split.ranks)
    ]
    context = split.context_length or min(layout.context_length or 4096, MAX_CONTEXT)
    try:
        plan = plan_split(
            name, layout, offers, head="rank0", context_length=context, min_ranks=split.ranks
        )
    except PlanError as exc:
        raise NodeError(str(exc)) from None
    print(plan.render(), flush=True)
    return plan


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free right now (all bound at once, so no repeats)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
