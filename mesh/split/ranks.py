"""A split model's group, led from this node (the head) and supervised as one worker.

:class:`SplitWorkerProcess` is a :class:`~mesh.workers.WorkerProcess` whose child is rank 0 of
a pipeline split (``python -m worker.serve.split_rank --serve``: the normal worker HTTP API, so the
gateway sees one more worker). Each forming of the group:

1. plans the split over this node's share and the members that offer memory (gossip, via
   :class:`~mesh.split.coordinator.SplitMesh`); while no plan fits, the model has no route
   (listed here, a request for it is 503 with Retry-After; not advertised to peers) and the
   reason is logged once, and it re-plans whenever the offers change;
2. gives the group a fresh id and opens the ring: this node's ranks get fresh loopback ports
   (registered with its bridge), every remote rank a local bridge link (mesh/split/bridge.py);
3. orders every remote rank from its node (one tunnel stream each, the rank's lease) and waits
   until they all run (a member may first copy its files from this node);
4. starts this node's other ranks, then rank 0, and serves the model (its route is listed).

No ``mlx.launch``, no SSH: the mesh writes every rank's ``MLX_RANK`` and hostfile. The group
lives and dies as one: rank 0 exits when a peer is gone or a step misses its deadline
(worker/serve/split_rank.py); a local rank that exits or a remote rank whose stream ends takes rank 0
down; the worker's restart loop then re-forms the group, re-planned over who offers now.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from pathlib import Path

from mesh.errors import NodeError, PlanError, SplitError
from mesh.loopback_ports import free_ports
from mesh.split.bridge import BridgeLink
from mesh.split.coordinator import RankReport, RemoteRank, SplitMesh, new_group_id
from mesh.split.host import open_link
from mesh.split.orders import RankOrder
from mesh.split.plan import (
    FIT_SHARE,
    Offer,
    SplitPlan,
    choose_offers,
    fits_whole,
    node_of,
    plan_split,
    whole_model_bytes,
)
from mesh.split.processes import spawn_rank, stop_process, wake
from mesh.workers import SplitOptions, WorkerOptions, WorkerProcess, WorkerState, served_name
from worker.split.signals import LOCKSTEP_VERSION, WAKE_LINE

log = logging.getLogger(__name__)

FOLLOWER_GRACE_S = 2.0  # rank 0 exits by itself this soon after a follower went (BROKEN_GRACE_S)
MAX_CONTEXT = 32768  # KV reserved by default: a long-context model's full window rarely fits
SETTLE_S = 5.0  # before the first plan: time for linked members' states (their offers) to come
REPLAN_S = 10.0  # while waiting for memory: re-plan at least this often
MEMORY_ENV = "MLX_MESH_MEMORY_BYTES"
PROMPT_CACHE_BYTES = 2 << 30  # the worker's default prompt-cache budget
DOZE_AFTER_S = 1.0  # idle this long, the other ranks leave the ring's busy wait (_on_output)


class SplitWorkerProcess(WorkerProcess):
    """Rank 0 (the served worker) of one model, and the rest of its group."""

    def __init__(self, model: str, options: WorkerOptions, mesh: SplitMesh | None = None) -> None:
        super().__init__(model, options)
        assert options.split is not None
        from worker import store
        from worker.split.layout import LayoutError, read_layout

        self.path = store.resolve_model(options.home, model)
        try:
            self.layout = read_layout(self.path)
        except LayoutError as exc:
            raise NodeError(f"cannot split {self.name}: {exc}") from None
        self.mesh = mesh
        self.plan: SplitPlan | None = None
        self.group = ""
        self.followers: list[asyncio.subprocess.Process] = []
        self.remotes: list[RemoteRank] = []
        self._links: list[BridgeLink] = []
        self._follower_output: list[asyncio.Task[None]] = []
        self._hostfile = options.home / "run" / f"split-{self.name}.json"
        self._watch: asyncio.Task[None] | None = None
        self._waiting = asyncio.Event()
        self._waiting_why = ""
        self._first: asyncio.Task[str] | None = None
        self._broken_why = ""
        self._remote_plan = False  # the current plan has ranks on other nodes

    # ---------------------------------------------------------------- the worker's hooks

    def _command(self) -> list[str]:
        assert self.options.split is not None and self.plan is not None
        return [
            self.options.python, "-m", "worker.serve.split_rank", "--serve",
            "--model", self.path, "--name", self.name, "--split", _split_arg(self.plan),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--step-deadline-s", str(self.options.split.step_deadline_s),
            "--prompt-cache-gb", f"{prompt_cache_bytes(self.plan) / (1 << 30):.6f}",
            "--doze-after-s", str(DOZE_AFTER_S),
            "--speculation", self.options.speculation,
        ]  # fmt: skip

    def _env(self) -> dict[str, str]:
        return {**super()._env(), "MLX_RANK": "0", "MLX_HOSTFILE": str(self._hostfile)}

    def _on_output(self, line: str) -> bool:
        """Rank 0 asks for its dozing ranks to be woken: a byte on each local one's stdin, a
        wake on each remote one's order stream."""
        if line != WAKE_LINE:
            return False
        for follower in self.followers:
            wake(follower)
        for remote in self.remotes:
            remote.wake()
        return True

    async def start(self) -> str:
        """Form the group; if it must wait for members to offer memory, start serving
        without it (the model is listed once the group forms)."""
        self._first = asyncio.create_task(self._spawn(), name=f"split-{self.name}-first")
        waiting = asyncio.create_task(self._waiting.wait())
        try:
            await asyncio.wait([self._first, waiting], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
        if self._first.done() and (self._first.exception() is None or not self._remote_plan):
            self.url = self._first.result()  # a failure on this node alone fails its start
            await self._set_state(WorkerState.SERVING)
            self._supervisor = asyncio.create_task(self._supervise(), name=f"split-{self.name}")
            return self.url
        self._supervisor = asyncio.create_task(self._later(), name=f"split-{self.name}")
        return ""

    async def _later(self) -> None:
        """The first forming, finished after the node started; then the restart loop."""
        assert self._first is not None
        while True:
            try:
                self.url = await self._first
                await self._set_state(WorkerState.SERVING)
                break
            except (NodeError, OSError, TimeoutError) as exc:
                log.error("split model %s could not form: %s", self.name, exc)
                await asyncio.sleep(self.options.restart_backoff_max_s)
                self._first = asyncio.create_task(self._spawn())
        await self._supervise()

    async def _spawn(self) -> str:
        """(Re-)form the group (see the module docstring) and return rank 0's URL."""
        await self._teardown()
        plan = await self._wait_for_plan()
        self._remote_plan = any(node_of(s.node_id) != self._self_id for s in plan.stages)
        self.group = new_group_id()
        try:
            hosts = await self._open_ring(plan)
            self._hostfile.parent.mkdir(parents=True, exist_ok=True)
            self._hostfile.write_text(json.dumps(hosts))
            self.remotes = await self._order_remote_ranks(plan)
            for stage in plan.stages:
                if stage.rank != 0 and node_of(stage.node_id) == self._self_id:
                    await self._start_follower(plan, stage.rank)
            self.plan = plan
            url = await self._spawn_rank0()
        except SplitError as exc:
            await self._teardown()
            raise NodeError(f"split model {self.name}: {exc}") from None
        except BaseException:
            await self._teardown()
            raise
        if self.mesh is not None:
            self.mesh.plans[self.name] = plan
            self.mesh.waiting.pop(self.name, None)
        return url

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._first is not None and not self._first.done():
            self._first.cancel()
            await asyncio.wait([self._first])
        await super().stop(grace_s)
        await self._teardown()
        if self.mesh is not None:
            self.mesh.plans.pop(self.name, None)
            self.mesh.waiting.pop(self.name, None)

    # ---------------------------------------------------------------- planning

    @property
    def _self_id(self) -> str:
        return self.mesh.node_id if self.mesh is not None else "this-node"

    def make_plan(self) -> SplitPlan:
        """The plan over what is offered now (``PlanError`` in words when none fits)."""
        split = self.options.split
        assert split is not None
        remote: list[Offer] = self.mesh.offers() if self.mesh is not None else []
        offers, min_ranks = choose_offers(
            self._self_id,
            split.share_memory_bytes or physical_memory() // 2,
            remote,
            ranks=split.ranks,
            over=split.over,
        )
        context = context_for(self.layout.context_length, split)
        return plan_split(
            self.name,
            self.layout,
            offers,
            head=self._self_id,
            context_length=context,
            min_ranks=min_ranks,
        )

    async def _wait_for_plan(self) -> SplitPlan:
        mesh = self.mesh
        if mesh is not None and self.plan is None:
            loop = asyncio.get_running_loop()
            settle_until = loop.time() + SETTLE_S
            while not mesh.known_members_settled() and loop.time() < settle_until:
                await mesh.wait_changed(0.25)
        while True:
            try:
                plan = self.make_plan()
                break
            except PlanError as exc:
                if mesh is None:
                    raise NodeError(str(exc)) from None
                await self._wait_for_memory(str(exc))
        print(plan.render(), flush=True)
        return plan

    async def _wait_for_memory(self, why: str) -> None:
        assert self.mesh is not None
        if why != self._waiting_why:
            log.warning("split model %s waits for memory: %s", self.name, why)
            print(f"{self.name} waits for members to offer memory: {why}", flush=True)
        self._waiting_why = why
        self.mesh.waiting[self.name] = why
        self.mesh.plans.pop(self.name, None)
        self._waiting.set()
        await self._listing(False)
        await self.mesh.wait_changed(REPLAN_S)

    # ---------------------------------------------------------------- forming

    async def _open_ring(self, plan: SplitPlan) -> list[list[str]]:
        """Every rank's ring address as this node's ranks see it: a fresh loopback port for
        each rank here (registered with the bridge, for the remote ranks' links), a local
        bridge link for each rank elsewhere."""
        local = [s.rank for s in plan.stages if node_of(s.node_id) == self._self_id]
        ports = dict(zip(local, free_ports(len(local)), strict=True))
        hosts: list[list[str]] = []
        for stage in plan.by_rank():
            if stage.rank in ports:
                if self.mesh is not None:
                    self.mesh.bridge.register(self.group, stage.rank, ports[stage.rank])
                hosts.append([f"127.0.0.1:{ports[stage.rank]}"])
                continue
            assert self.mesh is not None
            link = await open_link(
                self.mesh.identity, self.mesh.bridge_of, stage.node_id, self.group, stage.rank
            )
            self._links.append(link)
            hosts.append([f"127.0.0.1:{link.port}"])
        return hosts

    async def _order_remote_ranks(self, plan: SplitPlan) -> list[RemoteRank]:
        remote = [s for s in plan.by_rank() if node_of(s.node_id) != self._self_id]
        if not remote:
            return []
        assert self.mesh is not None
        nodes = [node_of(s.node_id) for s in plan.by_rank()]
        orders = [
            RankOrder(
                group=self.group,
                model=self.name,
                rank=stage.rank,
                split=plan.layer_split(),
                nodes=nodes,
                files=self._files_for(stage.start, stage.end),
                need_bytes=stage.total_bytes,
                lockstep=LOCKSTEP_VERSION,
            )
            for stage in remote
        ]
        results = await asyncio.gather(
            *(self.mesh.order(order) for order in orders), return_exceptions=True
        )
        ranks = [r for r in results if isinstance(r, RemoteRank)]
        self.remotes = ranks  # so a failure below is torn down
        for result in results:
            if isinstance(result, BaseException):
                raise result
        async with asyncio.timeout(self.options.ready_timeout_s):
            await asyncio.gather(*(r.wait_running() for r in ranks))
        return ranks

    def _files_for(self, start: int, end: int) -> list[str]:
        """What a rank of layers [start, end) needs: its layers' shards, the shared ones, and
        every other file of the model (config, tokenizer, index)."""
        layout = self.layout
        needed = set(layout.shared_files)
        for layer in range(start, end):
            needed.update(layout.layer_files[layer])
        root = Path(self.path)
        for path in root.iterdir():
            if path.is_file() and path.suffix != ".safetensors":
                needed.add(path.name)
        return sorted(needed)

    async def _start_follower(self, plan: SplitPlan, rank: int) -> None:
        follower, output = await spawn_rank(
            self.options.python, Path(self.path), plan.layer_split(), rank, self._hostfile,
            label=f"{self.name} rank {rank}",
        )  # fmt: skip
        self._follower_output.append(output)
        self.followers.append(follower)

    # ---------------------------------------------------------------- the group's life

    async def _spawn_rank0(self) -> str:
        """Rank 0, raced against the other ranks: one that ends while the group forms would
        leave rank 0 waiting for the ring for good, so that fails the forming at once."""
        self._watch = asyncio.create_task(self._watch_group(), name=f"split-{self.name}-watch")
        serving = asyncio.ensure_future(super()._spawn())
        await asyncio.wait([serving, self._watch], return_when=asyncio.FIRST_COMPLETED)
        if serving.done():
            return serving.result()
        serving.cancel()
        await asyncio.wait([serving])
        if self.process is not None:
            await stop_process(self.process)
        raise SplitError(f"a rank ended while the group formed ({self._broken_why})")

    async def _group_broken(self) -> str:
        """Until a rank other than 0 ends: why."""
        waits: list[asyncio.Future[int | RankReport]]
        waits = [asyncio.ensure_future(f.wait()) for f in self.followers]
        waits += [asyncio.ensure_future(r.wait_exited()) for r in self.remotes]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        result = next(iter(done)).result()
        return f"exit status {result}" if isinstance(result, int) else (result.why or "gone")

    async def _watch_group(self) -> None:
        """A rank that exits here, or a remote rank whose stream ends, breaks the group: rank 0
        notices on its next step and exits; if it has not within the grace (idle, or wedged),
        it is killed, and the restart loop re-forms the group."""
        self._broken_why = why = await self._group_broken()
        if self._stopping:
            return
        log.warning("a rank of split model %s ended (%s); re-forming the group", self.name, why)
        await self._set_state(WorkerState.RESTARTING)  # no new request for a broken group
        process = self.process
        if process is None or process.returncode is not None:
            return
        try:
            async with asyncio.timeout(FOLLOWER_GRACE_S):
                await process.wait()
        except TimeoutError:
            process.kill()

    async def _teardown(self) -> None:
        """End the current group's other ranks, links and bridge routes (rank 0 is the
        worker's own business)."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.wait([self._watch])
            self._watch = None
        for remote in self.remotes:
            remote.close()
        self.remotes = []
        for follower in self.followers:
            await stop_process(follower)
        self.followers = []
        for task in self._follower_output:
            task.cancel()
        if self._follower_output:
            await asyncio.wait(self._follower_output)
        self._follower_output = []
        for link in self._links:
            await link.close()
        self._links = []
        if self.mesh is not None and self.group:
            self.mesh.bridge.unregister(self.group)

    def status(self) -> dict[str, object]:
        """``mesh status``: the group's stages, or why it waits."""
        if self.mesh is not None and self.name in self.mesh.waiting:
            return {"split": {"waiting": self.mesh.waiting[self.name]}}
        if self.plan is None:
            return {"split": {"forming": True}}
        return {
            "split": {
                "group": self.group,
                "stages": [
                    {"rank": s.rank, "node_id": node_of(s.node_id), "layers": [s.start, s.end]}
                    for s in self.plan.stages
                ],
            }
        }


class SplitProcesses:
    """The node's :class:`~mesh.workers.ProcessFactory` when it can split: a model given split
    options, or one too big for this node (:func:`split_if_too_big`), is served by a
    :class:`SplitWorkerProcess` over ``mesh``; any other by a plain worker."""

    def __init__(self, mesh: SplitMesh | None) -> None:
        self.mesh = mesh

    def __call__(self, model: str, options: WorkerOptions, /) -> WorkerProcess:
        if options.split is None and self.mesh is not None:
            split = split_if_too_big(model, options)
            options = dataclasses.replace(options, split=split) if split else options
        if options.split is None:
            return WorkerProcess(model, options)
        return SplitWorkerProcess(model, options, self.mesh)


def prompt_cache_bytes(plan: SplitPlan) -> int:
    """Each rank's prompt-cache budget: the worker's default (2 GiB), at most what the
    tightest rank's offer has left after its stage (the plan reserved nothing for it)."""
    return min(PROMPT_CACHE_BYTES, plan.headroom_bytes())


def _split_arg(plan: SplitPlan) -> str:
    return ",".join(str(n) for n in plan.layer_split())


def context_for(layout_context: int | None, options: SplitOptions | None) -> int:
    """The context a split reserves KV cache for."""
    wanted = options.context_length if options is not None else None
    return wanted or min(layout_context or 4096, MAX_CONTEXT)


def split_if_too_big(model: str, options: WorkerOptions) -> SplitOptions | None:
    """``mesh up --model BIG`` with no split flags: a split over the mesh's offers (as few
    ranks as hold it) when this node cannot hold the model whole, else None. Models that are
    no local layered decoder (a hub id, say) are served whole, as before."""
    from worker import store
    from worker.split.layout import LayoutError, read_layout

    path = store.resolve_model(options.home, model)
    try:
        layout = read_layout(path)
    except (LayoutError, OSError):
        return None
    memory = physical_memory()
    context = context_for(layout.context_length, None)
    if fits_whole(layout, context, memory):
        return None
    log.warning(
        "%s needs %.1f GB whole, more than this node can hold (%.0f%% of %.1f GB): "
        "splitting it over the members that offer memory",
        served_name(model), whole_model_bytes(layout, context) / 1e9,
        FIT_SHARE * 100, memory / 1e9,
    )  # fmt: skip
    return SplitOptions(ranks=0)


def physical_memory() -> int:
    """This machine's memory (``MLX_MESH_MEMORY_BYTES`` pretends another size, for tests)."""
    pretend = os.environ.get(MEMORY_ENV)
    if pretend:
        return int(float(pretend))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
