"""The member side of split serving: run a rank that a head ordered, for as long as it asks.

A node that offers memory (``mesh up --share-memory GB``) answers ``RankOrder`` streams
(mesh/split/orders.py) from members. For each it checks the order (the head runs rank 0, this
node runs the rank, the stage fits what is left of the offer), gets the model's files (its own
store's copy, or only the files the rank needs, copied from the head with peer copy), opens the
ring's loopback ports through the bridge (its own rank registered with this node's
:class:`~mesh.split.bridge.BridgeServer`, a :class:`~mesh.split.bridge.BridgeLink` for every
rank on another node), and starts ``python -m worker.serve.split_rank`` as a child that dies with the
node. The stream is the lease: it ends → the rank is killed; the rank exits → the stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson

from mesh.copy.client import CopySource
from mesh.errors import CopyError, MeshError, SplitError
from mesh.identity import NodeIdentity, short_id
from mesh.loopback_ports import free_ports
from mesh.split.bridge import BridgeLink, BridgeServer
from mesh.split.orders import RankOrder, RankReport, order_from_json
from mesh.split.processes import spawn_rank, stop_process, wake
from mesh.tunnel.frames import Body, Data, End, ErrorCode, ResponseHead
from worker.split.signals import LOCKSTEP_VERSION

log = logging.getLogger(__name__)

MAX_RANKS_HERE = 4  # groups one node runs ranks for at once, whatever the members ask


class OfferExhausted(SplitError):
    """The order is fine, but this node's offer has no room for it now (409, not 400)."""


@dataclass(frozen=True)
class BridgeAddress:
    """Where a member's ring bridge listens, and the certificate it must present."""

    host: str
    port: int
    cert: bytes


class RankHost:
    """Runs the ranks members order on this node, within ``offered_bytes``.

    ``bridge_of(node_id)`` finds a member's bridge (None: no link, no bridge, or unknown);
    ``copy_from(node_id, name)`` the copy source for a model held by that member."""

    def __init__(
        self,
        home: Path,
        identity: NodeIdentity,
        offered_bytes: int,
        bridge: BridgeServer,
        *,
        bridge_of: Callable[[str], BridgeAddress | None],
        copy_from: Callable[[str, str], list[CopySource]],
        python: str = sys.executable,
    ) -> None:
        self.home = home
        self.identity = identity
        self.node_id = identity.node_id
        self.offered_bytes = offered_bytes
        self.bridge = bridge
        self._bridge_of = bridge_of
        self._copy_from = copy_from
        self.python = python
        self.ranks: dict[str, RankOrder] = {}  # by group: what runs here now

    @property
    def used_bytes(self) -> int:
        return sum(order.need_bytes for order in self.ranks.values())

    def describe(self) -> list[dict[str, object]]:
        """The ranks running here (``mesh status``)."""
        return [
            {"group": o.group, "model": o.model, "rank": o.rank, "head": o.nodes[0]}
            for o in self.ranks.values()
        ]

    async def serve(self, stream, body: bytes, peer_id: str) -> None:
        """One order's whole life on its stream. Never raises for a peer's mistakes."""
        try:
            order = self._check(order_from_json(body), peer_id)
        except SplitError as exc:
            log.warning("split: refused a rank order from %s: %s", short_id(peer_id), exc)
            await _refuse(stream, 409 if isinstance(exc, OfferExhausted) else 400, str(exc))
            return
        self.ranks[order.group] = order
        try:
            await stream.send(ResponseHead(status=200))
            await _report(stream, RankReport(state="loading"))
            report = await self._run(stream, order)
            with contextlib.suppress(MeshError):
                await _report(stream, report)
                await stream.send(End())
        except MeshError as exc:
            log.info("split: the order stream for %s ended: %s", order.group, exc)
        finally:
            del self.ranks[order.group]
            self.bridge.unregister(order.group)

    def _check(self, order: RankOrder, peer_id: str) -> RankOrder:
        if order.lockstep != LOCKSTEP_VERSION:
            raise SplitError(
                f"the head speaks split lockstep version {order.lockstep}, this node "
                f"{LOCKSTEP_VERSION}: run the same mlx-mesh version on both"
            )
        if order.nodes[0] != peer_id:
            raise SplitError("only the node that runs rank 0 may order a group's ranks")
        if order.nodes[order.rank] != self.node_id or order.nodes.count(self.node_id) != 1:
            raise SplitError("the order does not give this node exactly its one rank")
        if order.group in self.ranks:
            raise SplitError(f"group {order.group} already runs here")
        if len(self.ranks) >= MAX_RANKS_HERE:
            raise OfferExhausted(f"this node's offer already runs {MAX_RANKS_HERE} ranks")
        left = self.offered_bytes - self.used_bytes
        if order.need_bytes > left:
            raise OfferExhausted(
                f"this node's offer has {_mb(left)} left of {_mb(self.offered_bytes)} "
                f"(--share-memory), the stage needs {_mb(order.need_bytes)}"
            )
        return order

    async def _run(self, stream, order: RankOrder) -> RankReport:
        """Files, ports, the process; then wait for the stream or the process to end."""
        links: list[BridgeLink] = []
        process = None
        try:
            # The rank's port is registered before the files are copied: the other ranks'
            # links may reach this bridge meanwhile, and wait for the rank to listen.
            (own,) = free_ports(1)
            self.bridge.register(order.group, order.rank, own)
            model_dir = await self._model_dir(order)
            hosts = await self._ring_addresses(order, own, links)
            hostfile = self.home / "run" / f"split-{order.group}-rank{order.rank}.json"
            hostfile.parent.mkdir(parents=True, exist_ok=True)
            hostfile.write_text(json.dumps(hosts))
            process, output = await spawn_rank(
                self.python, model_dir, order.split, order.rank, hostfile,
                label=f"{order.model} rank {order.rank}",
            )  # fmt: skip
            await _report(stream, RankReport(state="running"))
            log.info(
                "split: running rank %d of %s for %s (group %s)",
                order.rank, order.model, short_id(order.nodes[0]), order.group,
            )  # fmt: skip
            ended = asyncio.ensure_future(_listen(stream, process))
            exited = asyncio.ensure_future(process.wait())
            try:
                await asyncio.wait([ended, exited], return_when=asyncio.FIRST_COMPLETED)
            finally:
                ended.cancel()
                exited.cancel()
            code = process.returncode
            why = "the rank exited" if code is not None else "the head ended the group"
            await stop_process(process)
            output.cancel()
            return RankReport(state="exited", code=process.returncode, why=why)
        except (SplitError, CopyError, OSError) as exc:
            return RankReport(state="exited", why=str(exc))
        finally:
            if process is not None:
                await stop_process(process)
            for link in links:
                await link.close()

    async def _model_dir(self, order: RankOrder) -> Path:
        """The store's copy of the model, else the rank's files copied from the head (kept
        under ``run/split``, named by the file list, so the next forming reuses them)."""
        from mesh.copy.client import fetch_model
        from worker import store

        stored = store.model_path(self.home, order.model)
        if stored.is_dir():
            return stored
        if not order.files:
            raise SplitError(f"this node does not hold {order.model} and the order lists no files")
        digest = hashlib.sha256(orjson.dumps(sorted(order.files))).hexdigest()[:12]
        dest = self.home / "run" / "split" / f"{order.model}-{digest}"
        sources = self._copy_from(order.nodes[0], order.model)
        if not sources and not dest.is_dir():
            raise SplitError(f"{short_id(order.nodes[0])} offers no copy of {order.model}")
        try:
            return await fetch_model(
                self.home, self.identity, order.model, sources, files=order.files, dest=dest
            )
        except CopyError:
            shutil.rmtree(dest, ignore_errors=True)
            raise

    async def _ring_addresses(
        self, order: RankOrder, own: int, links: list[BridgeLink]
    ) -> list[list[str]]:
        """The hostfile: this rank's own loopback port, and for every other rank a local link
        to its node's bridge."""
        hosts: list[list[str]] = []
        for rank, node_id in enumerate(order.nodes):
            if rank == order.rank:
                hosts.append([f"127.0.0.1:{own}"])
                continue
            link = await open_link(self.identity, self._bridge_of, node_id, order.group, rank)
            links.append(link)
            hosts.append([f"127.0.0.1:{link.port}"])
        return hosts


async def open_link(
    identity: NodeIdentity,
    bridge_of: Callable[[str], BridgeAddress | None],
    node_id: str,
    group: str,
    rank: int,
) -> BridgeLink:
    """A local port that reaches rank ``rank`` of ``group`` on ``node_id`` through its bridge."""
    address = bridge_of(node_id)
    if address is None:
        raise SplitError(f"no link to {short_id(node_id)}'s ring bridge")
    link = BridgeLink(identity, (address.host, address.port), address.cert, node_id, group, rank)
    await link.start()
    return link


async def _listen(stream, process: asyncio.subprocess.Process) -> None:
    """The head's side of the order stream until it ends (the head ended the group, or the
    link is gone): each Body frame wakes the dozing rank."""
    with contextlib.suppress(MeshError):
        while isinstance(await stream.recv(), Body):
            wake(process)


async def _report(stream, report: RankReport) -> None:
    await stream.send(Data(report.model_dump_json().encode()))


async def _refuse(stream, status: int, message: str) -> None:
    with contextlib.suppress(MeshError):
        await stream.send(ResponseHead(status=status, headers={"x-error": message[:300]}))
        await stream.send(End(code=ErrorCode.REJECTED, message=message[:200]))


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n < 1e9 else f"{n / 1e9:.1f} GB"
