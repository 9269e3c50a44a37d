"""The mesh's side of peer copy: who may copy from us, who holds what, and pulling from them.

:class:`PeerCopy` runs this node's :class:`~mesh.copy.server.CopyServer` and answers
:meth:`PeerCopy.sources` from what the mesh already knows: gossip says which models each peer
holds in its store (``NodeState.stored``) and on which TCP port it serves copies
(``NodeState.copy_port``); the live QUIC link says the peer's address and the certificate it
proved in its handshake. That certificate is the pin for the TLS side channel both ways – the
server trusts the certificates of linked members only, the client only the one of the peer it
dials – so a stranger gets nothing and no certificate needs to be stored anywhere new.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from mesh.copy.client import CopyOptions, CopySource, fetch_model
from mesh.copy.progress import ProgressSink
from mesh.copy.server import CopyConfig, CopyServer
from mesh.errors import CopyError, PeerLost
from mesh.identity import NodeIdentity, short_id
from mesh.peers import PeerTable
from mesh.tunnel.connection import PeerConnection
from worker.store import models_dir

log = logging.getLogger(__name__)


def stored_model_names(home: Path) -> list[str]:
    """Names of the complete models in the store (cheap: no file is read)."""
    root = models_dir(home)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


class PeerCopy:
    def __init__(
        self,
        home: Path,
        identity: NodeIdentity,
        *,
        links: Callable[[], Mapping[str, PeerConnection]],
        members: Callable[[], Mapping[str, object]],
        peers: PeerTable,
        config: CopyConfig | None = None,
    ) -> None:
        self.home = home
        self.identity = identity
        self._links = links
        self._members = members
        self._peers = peers
        self.server = CopyServer(home, identity, self.trusted, config)
        self._pulls: dict[str, asyncio.Lock] = {}  # one copy per model at a time

    @property
    def port(self) -> int | None:
        return self.server.port

    async def start(self) -> None:
        try:
            await self.server.start()
        except OSError as exc:
            if self.server.config.port == 0:
                raise
            log.warning(
                "copy port %d unavailable (%s); using a free port", self.server.config.port, exc
            )
            self.server.config.port = 0
            await self.server.start()

    async def stop(self) -> None:
        await self.server.close()

    def trusted(self) -> dict[str, bytes]:
        """Node id → certificate DER of every member we hold a live, authenticated link to."""
        members = self._members()
        out = {}
        for node_id, conn in self._links().items():
            if node_id in members and conn.peer_certificate is not None and not conn.is_closed:
                out[node_id] = conn.peer_certificate.public_bytes(serialization.Encoding.DER)
        return out

    def holders(self) -> dict[str, list[str]]:
        """Model name → node ids of the UP peers that hold it in their store."""
        out: dict[str, list[str]] = {}
        for record in self._peers.up():
            for name in record.state.stored:
                out.setdefault(name, []).append(record.node_id)
        return out

    def sources(self, name: str, only: str | None = None) -> list[CopySource]:
        """Where NAME can be copied from now: linked UP peers that hold it and serve copies.
        ``only`` (a node id or unique prefix) keeps one peer; ``CopyError`` if it names none."""
        trusted = self.trusted()
        links = self._links()
        found = []
        for record in self._peers.up():
            node_id, state = record.node_id, record.state
            conn = links.get(node_id)
            if name not in state.stored or not state.copy_port or node_id not in trusted:
                continue
            host = conn.peer_host if conn is not None else None
            if host is None:
                continue
            found.append(CopySource(node_id, host, state.copy_port, trusted[node_id]))
        if only is None:
            return found
        wanted = only.strip().lower()
        chosen = [s for s in found if wanted and s.node_id.startswith(wanted)]
        if len(chosen) != 1:
            known = [n for n in self.trusted() if wanted and n.startswith(wanted)]
            if not known:
                raise CopyError(f"no linked member {only!r} in this mesh")
            raise CopyError(
                f"member {short_id(known[0])} does not hold {name} (or serves no copies)"
            )
        return chosen

    async def pull(
        self,
        name: str,
        *,
        only: str | None = None,
        on_progress: ProgressSink | None = None,
        options: CopyOptions | None = None,
    ) -> Path:
        """Copy NAME from the members that hold it into this node's store."""
        async with self._pulls.setdefault(name, asyncio.Lock()):
            sources = self.sources(name, only)
            if not sources:
                raise PeerLost(f"no linked member holds {name}")
            return await fetch_model(
                self.home, self.identity, name, sources, on_progress=on_progress, options=options
            )
