"""LAN discovery over mDNS/DNS-SD (zeroconf): find the members of our mesh again on the LAN.

Each node advertises ``<node id prefix>._mlx-mesh._udp.local.`` with TXT ``id`` (full node id),
``mh`` (a hash of the mesh id – never the secret) and ``v`` (protocol version), and browses for
the same type. Discovery only *finds*: the node dials a found member with its certificate pinned
and authenticates as usual, so a spoofed advertisement costs a failed handshake, nothing more.

The TXT codec and the dial decision are pure (:func:`encode_txt`, :func:`decode_txt`,
:func:`should_dial`); :class:`LanDiscovery` is the thin asyncio adapter over ``zeroconf``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations only: start() imports zeroconf when discovery starts
    from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

log = logging.getLogger(__name__)

SERVICE_TYPE = "_mlx-mesh._udp.local."
TXT_VERSION = "1"


def mesh_hash(mesh_id: str) -> str:
    """What the LAN may see of the mesh id: enough to recognise our mesh, not to join it."""
    return hashlib.sha256(b"mlx-mesh-discovery|" + mesh_id.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Advert:
    node_id: str
    mesh_hash: str
    addresses: tuple[str, ...] = ()  # host:port, filled from the mDNS records


def encode_txt(node_id: str, mesh_id: str) -> dict[str, str]:
    return {"id": node_id, "mh": mesh_hash(mesh_id), "v": TXT_VERSION}


def decode_txt(
    properties: Mapping[bytes, bytes | None] | Mapping[str, str | None],
) -> Advert | None:
    """An advert from raw TXT properties; None when it is not a (compatible) mlx-mesh node."""

    def text(value: bytes | str | None) -> str:
        if isinstance(value, bytes):
            return value.decode("utf-8", "replace")
        return value or ""

    props = {text(k): text(v) for k, v in properties.items()}
    node_id, mh = props.get("id", ""), props.get("mh", "")
    if props.get("v") != TXT_VERSION or len(node_id) != 64 or len(mh) != 16:
        return None
    try:
        bytes.fromhex(node_id)
        bytes.fromhex(mh)
    except ValueError:
        return None
    return Advert(node_id=node_id.lower(), mesh_hash=mh.lower())


def should_dial(
    advert: Advert,
    *,
    self_id: str,
    own_mesh_hash: str,
    members: Collection[str],
    connected: Collection[str],
) -> bool:
    """Dial a found node only if it is a known member of our mesh we are not yet connected to.

    Members only: dialing needs the member's certificate pin. A newcomer we do not know yet
    reaches us itself (it got our address in its Welcome), or we learn it through gossip.
    """
    return (
        advert.mesh_hash == own_mesh_hash
        and advert.node_id != self_id
        and advert.node_id in members
        and advert.node_id not in connected
        and bool(advert.addresses)
    )


class LanDiscovery:
    """Advertise this node and report adverts of other nodes to ``on_found``.

    ``on_found`` is called on the event loop with each resolved :class:`Advert`; the caller
    applies :func:`should_dial`. Failures to start (no multicast) are logged, not fatal: static
    peers keep working.
    """

    def __init__(
        self,
        *,
        node_id: str,
        mesh_id: str,
        port: int,
        host_addresses: list[str],
        on_found: Callable[[Advert], None],
    ) -> None:
        self.node_id = node_id
        self.mesh_id = mesh_id
        self.port = port
        self.host_addresses = host_addresses
        self.on_found = on_found
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info: AsyncServiceInfo | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        from zeroconf import IPVersion, ServiceStateChange
        from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

        self._state_added = (ServiceStateChange.Added, ServiceStateChange.Updated)
        addresses = [socket.inet_aton(a) for a in self.host_addresses if _is_ipv4(a)]
        self._info = AsyncServiceInfo(
            SERVICE_TYPE,
            f"{self.node_id[:16]}.{SERVICE_TYPE}",
            port=self.port,
            properties=encode_txt(self.node_id, self.mesh_id),
            addresses=addresses or None,
            server=f"mlx-mesh-{self.node_id[:16]}.local.",
        )
        try:
            self._zc = AsyncZeroconf(ip_version=IPVersion.V4Only)
            self._browser = AsyncServiceBrowser(
                self._zc.zeroconf, SERVICE_TYPE, handlers=[self._on_change]
            )
        except OSError as exc:
            log.warning("LAN discovery unavailable (%s); static peers still work", exc)
            await self.stop()
            return
        # Registering probes the name for about a second: do not hold up the node's start.
        self._spawn(self._register())

    async def _register(self) -> None:
        from zeroconf import NonUniqueNameException

        assert self._zc is not None and self._info is not None
        try:
            await self._zc.async_register_service(self._info)
        except (OSError, NonUniqueNameException) as exc:
            log.warning("cannot advertise on the LAN (%s); peers can still dial us", exc)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_change(self, zeroconf, service_type: str, name: str, state_change) -> None:
        if state_change in self._state_added:
            self._spawn(self._resolve(service_type, name))

    async def _resolve(self, service_type: str, name: str) -> None:
        from zeroconf.asyncio import AsyncServiceInfo

        if self._zc is None:
            return
        info = AsyncServiceInfo(service_type, name)
        if not await info.async_request(self._zc.zeroconf, 3000):
            return
        advert = decode_txt(info.properties or {})
        if advert is None or advert.node_id == self.node_id:
            return
        addresses = tuple(f"{ip}:{info.port}" for ip in info.parsed_addresses())
        self.on_found(Advert(advert.node_id, advert.mesh_hash, addresses))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._browser is not None:
            await self._browser.async_cancel()
            self._browser = None
        if self._zc is not None:
            zc, self._zc = self._zc, None
            try:
                # Closing sends the goodbyes for what we registered; never let it hold up a
                # node's shutdown.
                async with asyncio.timeout(3.0):
                    await zc.async_close()
            except (OSError, TimeoutError) as exc:
                log.warning("mDNS shutdown incomplete: %s", exc)


def _is_ipv4(address: str) -> bool:
    try:
        socket.inet_aton(address)
    except OSError:
        return False
    return address.count(".") == 3
