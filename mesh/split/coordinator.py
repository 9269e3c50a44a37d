"""What split serving needs of the mesh, in one place: offers, bridges, rank orders.

:class:`SplitMesh` is made by the :class:`~mesh.service.MeshService` and handed to the node's
split workers (mesh/split/ranks.py). It runs this node's ring :class:`BridgeServer`, answers
members' rank orders when this node offers memory (:class:`~mesh.split.host.RankHost`), tells a
head which members offer how much (from gossip), and opens :class:`RemoteRank` streams to them.
Anything that changes the offers (a member's state, a link lost) bumps :attr:`changed`, so a
group waiting for memory re-plans at once instead of on a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from mesh.copy.client import CopySource
from mesh.errors import MeshError, SplitError
from mesh.gossip import StageAd
from mesh.identity import NodeIdentity, short_id
from mesh.peers import PeerTable
from mesh.split.bridge import BridgeServer
from mesh.split.host import BridgeAddress, RankHost
from mesh.split.orders import SPLIT_RANK_PATH, RankOrder, RankReport, report_from_json
from mesh.split.plan import Offer, SplitPlan, node_of
from mesh.tunnel.connection import PeerConnection
from mesh.tunnel.frames import Body, Data, End, ErrorCode, RequestHead, ResponseHead

log = logging.getLogger(__name__)

ORDER_TIMEOUT_S = 10.0  # the member's first answer (accepted or refused), and the order itself
WAKE = b"wake"


class SplitMesh:
    def __init__(
        self,
        home: Path,
        identity: NodeIdentity,
        *,
        links: Callable[[], Mapping[str, PeerConnection]],
        members: Callable[[], Iterable[str]],
        peers: PeerTable,
        trusted: Callable[[], dict[str, bytes]],
        copy_from: Callable[[str, str], list[CopySource]],
        offered_bytes: int = 0,
        python: str = sys.executable,
    ) -> None:
        self.identity = identity
        self.node_id = identity.node_id
        self.offered_bytes = offered_bytes
        self._links = links
        self._members = members
        self._peers = peers
        self._trusted = trusted
        self.bridge = BridgeServer(identity, lambda: trusted().values())
        self.host: RankHost | None = None
        if offered_bytes > 0:
            self.host = RankHost(
                home, identity, offered_bytes, self.bridge,
                bridge_of=self.bridge_of, copy_from=copy_from, python=python,
            )  # fmt: skip
        self.plans: dict[str, SplitPlan] = {}  # model → the plan its group runs now (head side)
        self.waiting: dict[str, str] = {}  # model → why it waits for memory (head side)
        self.changed = asyncio.Event()

    @property
    def port(self) -> int | None:
        return self.bridge.port or None

    async def start(self, host: str, port: int = 0) -> None:
        try:
            await self.bridge.start(host, port)
        except OSError as exc:
            if port == 0:
                raise
            log.warning("bridge port %d unavailable (%s); using a free port", port, exc)
            await self.bridge.start(host, 0)

    async def stop(self) -> None:
        await self.bridge.close()

    def notify(self) -> None:
        """Offers may have changed (gossip, a link up or down): wake groups waiting for them."""
        self.changed.set()

    async def wait_changed(self, at_most_s: float) -> None:
        """Until the offers may have changed, or ``at_most_s`` passed."""
        self.changed.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(at_most_s):
                await self.changed.wait()

    # ---------------------------------------------------------------- facts from the mesh

    def offers(self) -> list[Offer]:
        """Members that are up, linked and offer memory for ranks (what is left of it)."""
        links = self._links()
        out = []
        for record in self._peers.up():
            state = record.state
            left = state.share_memory - state.share_memory_used
            conn = links.get(record.node_id)
            if left > 0 and state.bridge_port and conn is not None and not conn.is_closed:
                out.append(Offer(record.node_id, left, short_id(record.node_id)))
        return out

    def known_members_settled(self) -> bool:
        """Every member is linked and has told us its state (so its offer, if any, is known).
        A member that is away keeps this False: the caller waits only so long for it."""
        states = {r.node_id for r in self._peers.up()}
        links = self._links()
        return all(
            node_id in states and node_id in links
            for node_id in self._members()
            if node_id != self.node_id
        )

    def bridge_of(self, node_id: str) -> BridgeAddress | None:
        conn = self._links().get(node_id)
        record = self._peers.peers.get(node_id)
        cert = self._trusted().get(node_id)
        host = conn.peer_host if conn is not None and not conn.is_closed else None
        port = record.state.bridge_port if record is not None else None
        if host is None or not port or cert is None:
            return None
        return BridgeAddress(host, int(port), cert)

    def stages(self, model: str) -> list[StageAd]:
        plan = self.plans.get(model)
        if plan is None:
            return []
        return [
            StageAd(rank=s.rank, node_id=node_of(s.node_id), start=s.start, end=s.end)
            for s in plan.stages
        ]

    def status(self) -> dict[str, object]:
        """``mesh status``: offer, ranks run here for others, groups led here."""
        return {
            "share_memory": self.offered_bytes,
            "share_memory_used": self.host.used_bytes if self.host else 0,
            "ranks": self.host.describe() if self.host else [],
            "groups": {model: [s.model_dump() for s in self.stages(model)] for model in self.plans},
            "waiting": dict(self.waiting),
        }

    # ---------------------------------------------------------------- orders

    async def serve(self, stream, peer_id: str) -> None:
        """A member's rank order (the tunnel server's handler for ``SPLIT_RANK_PATH``): the
        order is the first Body frame; the ones after it wake the rank (orders.py)."""
        try:
            async with asyncio.timeout(ORDER_TIMEOUT_S):
                first = await stream.recv()
        except (MeshError, TimeoutError) as exc:
            log.info("split: no rank order from %s (%s)", short_id(peer_id), exc)
            stream.reset()
            return
        if self.host is None or not isinstance(first, Body):
            why = "this node offers no memory" if self.host is None else "no rank order"
            await stream.send(ResponseHead(status=409, headers={"x-error": why}))
            await stream.send(End(code=ErrorCode.REJECTED, message=why))
            return
        await self.host.serve(stream, first.data, peer_id)

    async def order(self, order: RankOrder) -> RemoteRank:
        """Send ``order`` to the node that is to run its rank; its acceptance, or a
        :class:`SplitError` saying why not."""
        node_id = order.nodes[order.rank]
        conn = self._links().get(node_id)
        if conn is None or conn.is_closed:
            raise SplitError(f"no live link to {short_id(node_id)}")
        return await RemoteRank.open(conn, node_id, order)


def new_group_id() -> str:
    return secrets.token_hex(6)


class RemoteRank:
    """The head's side of one remote rank's order stream (see mesh/split/orders.py)."""

    def __init__(self, node_id: str, order: RankOrder, stream) -> None:
        self.node_id = node_id
        self.order = order
        self._stream = stream
        self.last: RankReport | None = None
        self._wakes: set[asyncio.Task[None]] = set()

    @classmethod
    async def open(cls, conn: PeerConnection, node_id: str, order: RankOrder) -> RemoteRank:
        try:
            stream = await conn.open_stream()
            await stream.send(RequestHead(id=order.group, path=SPLIT_RANK_PATH, deadline=None))
            # No BodyEnd: the request goes on for the group's life, its Body frames after the
            # order wake the rank (a dozing rank waits on its stdin, worker/serve/split_rank.py).
            await stream.send(Body(order.model_dump_json().encode()))
            async with asyncio.timeout(ORDER_TIMEOUT_S):
                head = await stream.recv()
        except (MeshError, TimeoutError) as exc:
            raise SplitError(f"{short_id(node_id)} did not take the rank order ({exc})") from None
        if not isinstance(head, ResponseHead) or head.status != 200:
            why = head.headers.get("x-error", "") if isinstance(head, ResponseHead) else ""
            stream.reset()
            raise SplitError(f"{short_id(node_id)} refused rank {order.rank}: {why or head}")
        return cls(node_id, order, stream)

    async def next_report(self) -> RankReport:
        """The member's next report; an ``exited`` one when the stream ends in any way."""
        try:
            frame = await self._stream.recv()
        except MeshError as exc:
            return RankReport(state="exited", why=f"lost the order stream ({exc})")
        if isinstance(frame, Data):
            try:
                self.last = report_from_json(frame.data)
            except SplitError as exc:
                return RankReport(state="exited", why=str(exc))
            return self.last
        return RankReport(state="exited", why="the order stream ended")

    async def wait_running(self) -> None:
        """Until the rank process runs (its files copied); SplitError if it exited first."""
        while (report := await self.next_report()).state != "running":
            if report.state == "exited":
                raise SplitError(
                    f"rank {self.order.rank} on {short_id(self.node_id)} did not start: "
                    f"{report.why or report.code}"
                )

    async def wait_exited(self) -> RankReport:
        while (report := await self.next_report()).state != "exited":
            pass
        return report

    def wake(self) -> None:
        """Ask the member to wake its dozing rank (a Body frame on the order stream)."""
        task = asyncio.ensure_future(self._send_wake())
        self._wakes.add(task)
        task.add_done_callback(self._wakes.discard)

    async def _send_wake(self) -> None:
        with contextlib.suppress(MeshError):
            await self._stream.send(Body(WAKE))

    def close(self) -> None:
        """End the group on the member's side (it kills the rank)."""
        for task in self._wakes:
            task.cancel()
        self._stream.reset()
