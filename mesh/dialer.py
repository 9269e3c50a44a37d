"""The dialer: keeps trying to link every known member this node has no link to.

A member is dialed at LAN-found addresses first (fresher), then its remembered addresses, then
the static ``--peer`` addresses (pinned by node id, so a wrong one costs a refused handshake).
Failures back off exponentially per member, and are logged once at INFO while a member stays
away.

One rule keeps restarts quick: a link that was lost is restored by the node with the HIGHER id
dialing the lower one. While the lower id dials a peer, the tunnel holds that peer's own dial to
it until its dial ends (its simultaneous-dial tie rule); if both sides redialed, a restarted
node's dials would wait for the others' dials to its dead old address to time out.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from mesh.addresses import split_address
from mesh.errors import AddressError
from mesh.identity import short_id
from mesh.membership.members import Member

log = logging.getLogger(__name__)

# (node id, "host", port) → True once the peer is linked and authenticated.
LinkFunction = Callable[[str, str, int], Awaitable[bool]]


@dataclass
class Dialer:
    self_id: str
    members: Callable[[], Iterable[Member]]
    is_linked: Callable[[str], bool]
    link: LinkFunction
    static_peers: list[str] = field(default_factory=list)
    redial_s: float = 1.0
    max_backoff_s: float = 15.0
    clock: Callable[[], float] = time.monotonic
    # This node's own addresses: a member's remembered address that is one of them is stale
    # (that node moved, or changed identity, and we took its place) and would dial ourselves.
    own_addresses: Callable[[], Iterable[str]] = tuple
    _dialing: dict[str, asyncio.Task[None]] = field(default_factory=dict, init=False)
    _was_linked: set[str] = field(default_factory=set, init=False)
    _retry_at: dict[str, tuple[float, int]] = field(default_factory=dict, init=False)
    _found: dict[str, tuple[str, ...]] = field(default_factory=dict, init=False)

    # ---- facts from the service ----

    def on_linked(self, node_id: str) -> None:
        self._was_linked.add(node_id)
        self._retry_at.pop(node_id, None)

    def on_left(self, node_id: str) -> None:
        """The peer said it is leaving: do not hammer it; it dials us when it is back."""
        self._retry_at[node_id] = (self.clock() + self.max_backoff_s, 4)

    def on_found(self, node_id: str, addresses: tuple[str, ...]) -> None:
        """Seen on the LAN: dial it at the next round, whoever has the higher id."""
        self._found[node_id] = addresses
        self._retry_at.pop(node_id, None)
        self._was_linked.discard(node_id)

    def found(self, node_id: str) -> tuple[str, ...]:
        return self._found.get(node_id, ())

    # ---- the loop ----

    async def run(self) -> None:
        try:
            while True:
                self.dial_due(self.clock())
                await asyncio.sleep(self.redial_s)
        finally:
            tasks = list(self._dialing.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def dial_due(self, now: float) -> None:
        for member in list(self.members()):
            node_id = member.node_id
            if node_id == self.self_id or self.is_linked(node_id) or node_id in self._dialing:
                continue
            if now < self._retry_at.get(node_id, (0.0, 0))[0]:
                continue
            if node_id > self.self_id and node_id in self._was_linked:
                continue  # the higher id restores a lost link (module docstring)
            task = asyncio.get_running_loop().create_task(self._dial(member))
            self._dialing[node_id] = task
            task.add_done_callback(functools.partial(self._dial_ended, node_id))

    def _dial_ended(self, node_id: str, _task: asyncio.Task[None]) -> None:
        self._dialing.pop(node_id, None)

    async def _dial(self, member: Member) -> None:
        candidates = [*self.found(member.node_id), *member.addresses, *self.static_peers]
        own = set(self.own_addresses())
        problems: list[str] = []
        for address in dict.fromkeys(candidates):
            if address in own:
                problems.append(f"{address} (this node's own address)")
                continue
            if self.is_linked(member.node_id):
                return
            try:
                host, port = split_address(address)
            except AddressError as exc:
                problems.append(str(exc))
                continue
            if await self.link(member.node_id, host, port):
                return
            problems.append(address)
        _, failures = self._retry_at.get(member.node_id, (0.0, 0))
        delay = min(self.max_backoff_s, self.redial_s * 2**failures)
        self._retry_at[member.node_id] = (self.clock() + delay, failures + 1)
        level = logging.INFO if failures == 0 else logging.DEBUG  # once while it stays away
        log.log(
            level, "cannot reach member %s at %s", short_id(member.node_id), ", ".join(problems)
        )
