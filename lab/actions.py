"""What the fault lab does at each step of a scenario's timeline: :class:`Timeline`, which
:class:`lab.netlab.NetLab` composes (it owns the duty cycles it starts; the lab gives it its
links, nodes and the node controls through :class:`Lab`).

Link steps change the chaos proxies; node steps signal a node's whole process tree (the node and
its worker, which runs in its own session); ``slow`` duty-cycles SIGSTOP/SIGCONT on the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from typing import Protocol

from lab.links import LinkFabric
from lab.nodes import LabError, LabNode
from lab.procs import ProcessRegistry, cmdline
from lab.scenario import (
    ClearStep,
    FaultStep,
    HealStep,
    NodeStep,
    PartitionStep,
    Scenario,
    SlowStep,
)


class Lab(Protocol):
    """What the timeline needs of the lab that runs it."""

    scenario: Scenario
    fabric: LinkFabric | None
    nodes: list[LabNode]
    registry: ProcessRegistry

    def event(self, what: str, **details: object) -> None: ...

    async def start_node(self, node: LabNode, join_token: str | None) -> None: ...

    async def join(self, node: LabNode, *, wait: bool) -> None: ...


class Timeline:
    """Plays a scenario's steps on a lab at their times; owns the ``slow`` duty cycles."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self._slow_tasks: dict[int, asyncio.Task] = {}

    async def apply(self, step: object) -> None:
        assert self.lab.fabric is not None
        handlers: dict[type, Callable] = {
            FaultStep: self._fault,
            ClearStep: self._clear,
            PartitionStep: self._partition,
            HealStep: self._heal,
            NodeStep: self._node_step,
            SlowStep: self._slow,
        }
        await handlers[type(step)](step)

    async def _fault(self, step: FaultStep) -> None:
        self.lab.fabric.set_link(step.link, step.settings)  # type: ignore[union-attr]
        self.lab.event("fault", link=step.link, **step.settings.model_dump(exclude_defaults=True))

    async def _clear(self, step: ClearStep) -> None:
        self.lab.fabric.clear(step.link)  # type: ignore[union-attr]
        self.lab.event("clear", link=step.link or "all")

    async def _partition(self, step: PartitionStep) -> None:
        self.lab.fabric.partition(step.groups)  # type: ignore[union-attr]
        self.lab.event("partition", groups=step.groups)

    async def _heal(self, step: HealStep) -> None:
        self.lab.fabric.clear()  # type: ignore[union-attr]
        self.lab.event("heal")

    async def _node_step(self, step: NodeStep) -> None:
        node = self.lab.nodes[step.node]
        if step.action == "join":
            await self.lab.join(node, wait=False)
            return
        if step.action == "restart":
            if node.running():
                raise LabError(
                    f"restart of node {node.index}, which is still running: kill it first"
                )
            await self.lab.start_node(node, join_token=None)  # it is a member: its home remembers
            return
        if node.process is None:
            raise LabError(f"{step.action} of node {node.index}, which never started")
        self.lab.registry.note_descendants()
        sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "cont": signal.SIGCONT}[step.action]
        node.process.signal_tree(sig)
        if step.action == "kill":
            await asyncio.to_thread(node.process.popen.wait, 10)
        self.lab.event(step.action, node=node.index)

    async def _slow(self, step: SlowStep) -> None:
        old = self._slow_tasks.pop(step.node, None)
        if old is not None:
            old.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await old
        if step.duty < 1:
            self._slow_tasks[step.node] = asyncio.create_task(self._duty_cycle(step))
        self.lab.event("slow", node=step.node, duty=step.duty)

    async def _duty_cycle(self, step: SlowStep) -> None:
        """SIGSTOP/SIGCONT the node's worker processes (its whole tree if none is found)."""
        node = self.lab.nodes[step.node]
        assert node.process is not None
        period = step.period_ms / 1000
        try:
            while True:
                pids = [
                    p for p in node.process.tree()[1:] if "worker" in cmdline(p)
                ] or node.process.tree()
                _signal_all(pids, signal.SIGSTOP)
                await asyncio.sleep(period * (1 - step.duty))
                _signal_all(pids, signal.SIGCONT)
                await asyncio.sleep(period * step.duty)
        finally:
            _signal_all(node.process.tree(), signal.SIGCONT)  # never leave it frozen

    async def play(self, started_at: float) -> None:
        for step in self.lab.scenario.steps:
            delay = started_at + step.at - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await self.apply(step)
        remaining = started_at + self.lab.scenario.duration_s - time.time()
        if remaining > 0:
            await asyncio.sleep(remaining)

    async def stop_slowing(self) -> None:
        """End every duty cycle (each one SIGCONTs its node on the way out)."""
        for task in self._slow_tasks.values():
            task.cancel()
        for task in self._slow_tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._slow_tasks.clear()


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
