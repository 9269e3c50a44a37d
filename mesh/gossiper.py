"""Gossip on the links: this node's state to every peer on change and every few seconds (with
the workers' load, when a probe is given), the links' RTTs into the peer table, and the peer
table's verdicts in the log. What peers gossip back is the service's to handle."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from mesh.errors import MeshError
from mesh.gossip import GossipMessage, GossipPublisher, NodeState
from mesh.identity import short_id
from mesh.peers import PeerEvent, PeerJoined, PeerTable, PeerWentDown
from mesh.tunnel.connection import PeerConnection
from mesh.tunnel.frames import Control

log = logging.getLogger(__name__)

LoadProbe = Callable[[], Awaitable[dict[str, Any]]]


class Gossiper:
    """Publishes ``state()`` to ``links()`` and ticks the peer table; :meth:`run` until cancelled."""

    def __init__(
        self,
        node_id: str,
        *,
        links: Callable[[], dict[str, PeerConnection]],
        peers: PeerTable,
        state: Callable[[], NodeState],
        interval_s: float,
        load_probe: LoadProbe | None = None,
    ) -> None:
        self._links = links
        self._peers = peers
        self._state = state
        self._interval_s = interval_s
        self._load_probe = load_probe
        self._publisher = GossipPublisher(node_id, interval_s=interval_s)
        self.last_state: NodeState | None = None  # what a new link is told first
        self.load: dict[str, Any] = {}  # the workers' load, as the probe last found it, and when

    async def run(self) -> None:
        probe_at = 0.0
        while True:
            now = time.monotonic()
            if self._load_probe is not None and now >= probe_at:
                probe_at = now + self._interval_s
                try:
                    async with asyncio.timeout(1.0):
                        load = await self._load_probe()
                    # When it was measured: routing drains an old queue depth by its age.
                    self.load = {**load, "probed_at": time.monotonic()}
                except (OSError, TimeoutError, ValueError) as exc:
                    log.debug("load probe failed: %s", exc)
            try:
                await self._round(now)
            except Exception:
                # One bad round (a bug) must not silence this node for good: peers would
                # mark it down. Log it with its traceback and try again next round.
                log.exception("gossip round failed")
            await asyncio.sleep(min(0.5, self._interval_s / 2))

    async def _round(self, now: float) -> None:
        state = self._publisher.poll(self._state(), now)
        if state is not None:
            self.last_state = state
            await self.broadcast(gossip_frame(state))
        for peer_id, conn in list(self._links().items()):
            if conn.rtt is not None:
                self._peers.on_rtt(peer_id, conn.rtt)
        log_peer_events(self._peers.tick(now))

    async def broadcast(self, frame: Control) -> None:
        """``frame`` on every link's control stream; a link that cannot take it is skipped."""
        for peer_id, conn in list(self._links().items()):
            try:
                async with asyncio.timeout(1.0):
                    await conn.control.send(frame)  # type: ignore[union-attr]
            except (MeshError, TimeoutError) as exc:
                log.debug("gossip to %s failed: %s", short_id(peer_id), exc)


def gossip_frame(message: GossipMessage) -> Control:
    return Control(kind="gossip", body=message.model_dump())


def log_peer_events(events: list[PeerEvent]) -> None:
    """The peer table's verdicts, as a person reading the log wants them."""
    for event in events:
        if isinstance(event, PeerJoined):
            log.info("peer %s joined", short_id(event.node_id))
        elif isinstance(event, PeerWentDown):
            log.info("peer %s is down: %s", short_id(event.node_id), event.reason)
        else:
            log.info("peer %s dropped: %s", short_id(event.node_id), event.reason)
