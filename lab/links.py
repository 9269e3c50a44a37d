"""The lab's network: one chaos proxy (:mod:`lab.chaos`) per ordered pair of nodes.

Node *i* reaches node *j* only through ``proxy(i, j)``, which relays to *j*'s mesh port. A fault
on direction ``a → b`` is set on both proxies that carry such datagrams: ``proxy(a, b)``'s
upstream lane (a's connection to b) and ``proxy(b, a)``'s downstream lane (replies on b's
connection to a), so it holds whichever side dialled. A fault step replaces every setting of its
direction (fields it leaves out go back to their defaults).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Iterable

from lab.chaos import ChaosProxy
from lab.scenario import FaultSettings, parse_link, partition_directions

Direction = tuple[int, int]


def chaos_fields(settings: FaultSettings) -> dict[str, object]:
    """Scenario settings → :class:`lab.chaos.Faults` fields (kbit/s → bytes/s)."""
    return {
        "loss": settings.loss,
        "delay_ms": settings.delay_ms,
        "jitter_ms": settings.jitter_ms,
        "duplicate": settings.duplicate,
        "blackhole": settings.blackhole,
        "bandwidth": settings.bandwidth_kbps * 125 if settings.bandwidth_kbps else None,
    }


class LinkFabric:
    """All proxies of one lab run; faults are changed while the mesh runs."""

    def __init__(self, mesh_ports: list[int], *, seed: int | None = None) -> None:
        self.mesh_ports = mesh_ports
        self.proxies: dict[Direction, ChaosProxy] = {}
        self.faults: dict[Direction, FaultSettings] = {}  # what is set now, for the log
        self._seed = seed

    async def start(self) -> None:
        for index, (i, j) in enumerate(itertools.permutations(range(len(self.mesh_ports)), 2)):
            seed = None if self._seed is None else self._seed * 1000 + index
            proxy = ChaosProxy(("127.0.0.1", self.mesh_ports[j]), seed=seed)
            self.proxies[(i, j)] = proxy  # registered first, so close() covers a failed start
            await proxy.start()

    async def close(self) -> None:
        for proxy in self.proxies.values():
            await proxy.close()

    def address(self, src: int, dst: int) -> str:
        """Where node ``src`` dials to reach node ``dst``."""
        return f"127.0.0.1:{self.proxies[(src, dst)].port}"

    def peers_of(self, node: int) -> list[str]:
        return [self.address(node, other) for other in range(len(self.mesh_ports)) if other != node]

    def set_direction(self, direction: Direction, settings: FaultSettings) -> None:
        a, b = direction
        fields = chaos_fields(settings)
        self.proxies[(a, b)].set_faults("up", **fields)
        self.proxies[(b, a)].set_faults("down", **fields)
        if settings == FaultSettings():
            self.faults.pop(direction, None)
        else:
            self.faults[direction] = settings

    def set_link(self, link: str, settings: FaultSettings) -> None:
        for direction in parse_link(link):
            self.set_direction(direction, settings)

    def clear(self, link: str | None = None) -> None:
        directions: Iterable[Direction] = parse_link(link) if link else list(self.proxies)
        for direction in directions:
            self.set_direction(direction, FaultSettings())

    def partition(self, groups: list[list[int]]) -> None:
        for direction in partition_directions(groups):
            self.set_direction(direction, FaultSettings(blackhole=True))

    def datagrams(self, a: int, b: int) -> int:
        """Datagrams seen so far between nodes a and b (either proxy, either lane)."""
        return sum(
            lane.received for pair in ((a, b), (b, a)) for lane in self.proxies[pair].stats.values()
        )

    def stats(self) -> dict[str, dict[str, dict[str, int]]]:
        return {
            f"{i}->{j}": {lane: vars(s).copy() for lane, s in proxy.stats.items()}
            for (i, j), proxy in self.proxies.items()
        }


def namespace_support() -> tuple[bool, str]:
    """Could this machine run the lab on network namespaces + veth + nftables instead?

    Only detected and reported: the lab always uses the chaos proxies, which need no root.
    """
    missing = [tool for tool in ("ip", "nft") if shutil.which(tool) is None]
    if missing:
        return False, f"missing {', '.join(missing)}"
    try:
        probe = subprocess.run(
            ["ip", "netns", "list"], capture_output=True, timeout=5, check=False, text=True
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"ip netns failed: {exc}"
    if probe.returncode != 0:
        return False, f"ip netns: {probe.stderr.strip() or probe.returncode}"
    if os.geteuid() != 0:
        return False, "not root (namespaces and nftables need CAP_NET_ADMIN)"
    return True, "ip netns and nft present, running as root"
