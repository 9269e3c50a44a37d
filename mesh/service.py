"""MeshService: the asyncio adapter that runs membership, gossip and forwarding on the tunnel.

It owns the :class:`~mesh.tunnel.TunnelEndpoint` and, per peer connection, runs the membership
handshake (:class:`~mesh.admission.Admission`, ``Control(kind="auth")`` frames), then gossip on
the same control stream (``kind="gossip"``) and serves the peer's request streams with the LOCAL routes
(:class:`~mesh.tunnel_server.TunnelServer`). A background dialer keeps a link to every known member
(static ``--peer`` addresses and LAN discovery add addresses to try). The gateway sees the mesh
only through :attr:`MeshService.directory`.

Lifecycle::

    service = MeshService(home, identity, local_directory, MeshConfig(port=0, join_token=...))
    await service.start()        # creates or joins the mesh; raises MembershipError if refused
    app = create_app(service.directory, extra_routes=mesh_routes(service))
    ...
    await service.stop()         # announces Leave, closes every link
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.moa.track_record import TrackRecord
from gateway.responses.state import LocalResponses
from gateway.upstream import ModelDirectory
from mesh.addresses import default_addresses, split_address
from mesh.admission import Admission
from mesh.cache_stats import bounded
from mesh.connector import Connector
from mesh.control_inbox import ControlInbox
from mesh.copy.server import CopyConfig
from mesh.copy.service import PeerCopy, stored_model_names
from mesh.dialer import Dialer
from mesh.directory import MeshDirectory, offered_models
from mesh.discovery import Advert, LanDiscovery, mesh_hash, should_dial
from mesh.errors import AddressError, ConnectError, MembershipError, MeshError
from mesh.gossip import GossipMessage, Leave, Members, ModelAd, NodeState, gossip_from_dict
from mesh.gossiper import Gossiper, LoadProbe, gossip_frame, log_peer_events
from mesh.identity import NodeIdentity, short_id
from mesh.member_sync import SECRET_KIND, MemberSync
from mesh.membership.invite import InviteToken
from mesh.membership.members import MeshCredentials, load_credentials
from mesh.peer_upstream import PeerUpstream
from mesh.peers import PeerTable
from mesh.roster import RemovalReport, Roster, decode_join_token
from mesh.routing import held
from mesh.routing.planner import RoutingConfig
from mesh.split.coordinator import SplitMesh
from mesh.split.orders import SPLIT_RANK_PATH
from mesh.track_records import track_record_ads
from mesh.tunnel.config import DEFAULT_PORT, TunnelConfig
from mesh.tunnel.connection import PeerConnection
from mesh.tunnel.endpoint import TunnelEndpoint
from mesh.tunnel.frames import Control, ErrorCode
from mesh.tunnel_server import TunnelServer

log = logging.getLogger(__name__)


@dataclass
class MeshConfig:
    """How this node takes part in the mesh. Built by the CLI; tests pass ``port=0``."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    advertise: list[str] = field(default_factory=list)  # host:port peers dial; default: derived
    static_peers: list[str] = field(default_factory=list)  # host:port always tried
    join_token: str | None = None
    discovery: bool = True
    gossip_interval_s: float = 2.0
    down_after_s: float = 6.0
    drop_after_s: float = 30.0
    redial_s: float = 1.0
    max_redial_backoff_s: float = 15.0
    retry_backoff_s: float = 0.75
    auth_timeout_s: float = 5.0
    version: str = ""
    gateway_url: str = ""
    copy: CopyConfig | None = None  # the peer-copy server (TLS over TCP); None = not served
    # Split serving (mesh/split/): bytes this node offers to other nodes' split ranks, and
    # whether it runs the ring bridge (TCP, TLS, members only) at ``bridge_port`` at all.
    share_memory_bytes: int = 0
    bridge: bool = False
    bridge_port: int = 0
    tunnel: TunnelConfig = field(default_factory=TunnelConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)  # mesh/routing/


class MeshService:
    def __init__(
        self,
        home: Path,
        identity: NodeIdentity,
        local: ModelDirectory,
        config: MeshConfig | None = None,
        *,
        load_probe: LoadProbe | None = None,
        responses: LocalResponses | None = None,
    ) -> None:
        self.home = Path(home)
        self.identity = identity
        self.node_id = identity.node_id
        self.local = local
        self.config = config or MeshConfig()
        # model="mesh"'s counts per model on this node (its MixtureOfAgents records them), in
        # this node's state; the peers' come back through the directory (``track_records``).
        self.track_record = TrackRecord()
        self.peers = PeerTable(
            self.node_id,
            down_after_s=self.config.down_after_s,
            drop_after_s=self.config.drop_after_s,
        )
        self.directory = MeshDirectory(
            local,
            self.peers,
            self._peer_upstream,
            routing=self.config.routing,
            local_load=lambda: self.gossip.load,
            ask_held=self._ask_held,
        )
        self.tunnel_server = TunnelServer(
            local, responses, retry_backoff_s=self.config.retry_backoff_s
        )
        self.tunnel_server.handlers[held.HELD_PATH] = lambda stream, _peer: held.serve(stream, local)  # fmt: skip
        self.endpoint = TunnelEndpoint(
            identity, self.config.host, self.config.port, config=self.config.tunnel
        )
        self.roster = Roster(self.home, identity)
        self.members = self.roster.members
        self.admission = Admission(identity, self.home, self.members)
        self.connector = Connector(self.endpoint, self.admission, self.config.auth_timeout_s)
        self.links: dict[str, PeerConnection] = {}  # authenticated connections by peer id
        self.gossip = Gossiper(
            self.node_id,
            links=lambda: self.links,
            peers=self.peers,
            state=self.local_state,
            interval_s=self.config.gossip_interval_s,
            load_probe=load_probe,
        )
        self.dialer = Dialer(
            self.node_id,
            members=lambda: self.members.members.values(),
            is_linked=lambda node_id: node_id in self.links,
            link=self.connector.dial_member,
            static_peers=self.config.static_peers,
            redial_s=self.config.redial_s,
            max_backoff_s=self.config.max_redial_backoff_s,
            own_addresses=lambda: self.addresses,
        )
        self.copy = PeerCopy(
            self.home,
            identity,
            links=lambda: self.links,
            members=lambda: self.members.members,
            peers=self.peers,
            config=self.config.copy,
        )
        self.split = SplitMesh(
            self.home,
            identity,
            links=lambda: self.links,
            members=lambda: self.members.members,
            peers=self.peers,
            trusted=self.copy.trusted,
            copy_from=lambda node_id, name: self.copy.sources(name, only=node_id),
            offered_bytes=self.config.share_memory_bytes,
        )
        self.tunnel_server.handlers[SPLIT_RANK_PATH] = self.split.serve
        self.inbox = ControlInbox(
            {"gossip": lambda peer_id, body: self._on_gossip(peer_id, gossip_from_dict(body))}
        )
        self.sync = MemberSync(
            self.roster,
            self.admission,
            links=lambda: self.links,
            cut_off=self._cut_off,
            ignore=self.inbox.ignore,
            spawn=self._spawn,
        )
        self.inbox.handlers[SECRET_KIND] = self.sync.on_secret
        self._tasks: list[asyncio.Task[None]] = []
        self._discovery: LanDiscovery | None = None
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle

    @property
    def credentials(self) -> MeshCredentials | None:
        return self.admission.credentials

    @property
    def addresses(self) -> list[str]:
        return self.admission.addresses

    @property
    def mesh_id(self) -> str:
        return self.credentials.mesh_id if self.credentials else ""

    async def start(self) -> None:
        token = decode_join_token(self.config.join_token)
        self.admission.credentials = load_credentials(self.home)
        self.admission.credentials, token = self.roster.settle_credentials(self.credentials, token)
        self.endpoint.on_connection = self._on_connection
        try:
            await self.endpoint.start()
        except OSError as exc:
            if self.config.port == 0:
                raise MembershipError(f"cannot open the mesh tunnel: {exc}") from exc
            # Peers learn our addresses from the handshake and gossip, so any port works for
            # them; only static --peer entries pointing at the default port would miss us.
            log.warning("mesh port %d unavailable (%s); using a free port", self.config.port, exc)
            self.endpoint.port = 0
            await self.endpoint.start()
        self.admission.addresses = self.config.advertise or default_addresses(
            self.config.host, self.endpoint.port
        )
        self.roster.remember_self(self.addresses)
        if self.config.copy is not None:
            await self.copy.start()
        if self.config.bridge or self.config.share_memory_bytes:
            await self.split.start(self.config.host, self.config.bridge_port)
        if token is not None:
            try:
                await self.connector.join(token)
            except BaseException:
                await self.split.stop()
                await self.copy.stop()
                await self.endpoint.close()
                raise
            self.roster.remember_self(self.addresses)  # a member now: its own entry too
        loop = asyncio.get_running_loop()
        self._tasks += [loop.create_task(self.gossip.run()), loop.create_task(self.dialer.run())]
        if self.config.discovery:
            await self._start_discovery()

    async def stop(self) -> None:
        """Announce leaving, then close every link and the endpoint. Idempotent."""
        if self._stopping or self.credentials is None:
            return  # stopped already, or never got as far as knowing its mesh
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        leave = Control(kind="gossip", body=Leave(node_id=self.node_id).model_dump())
        for conn in list(self.links.values()):
            control = conn.control
            assert control is not None  # a link is past its handshake: its control stream is up
            with contextlib.suppress(MeshError, TimeoutError):
                async with asyncio.timeout(0.5):
                    await control.send(leave)
        await asyncio.sleep(0.05)  # let the Leave frames go out before the close frames
        if self._discovery is not None:
            await self._discovery.stop()
        await self.split.stop()
        await self.copy.stop()
        await self.endpoint.close()
        self.roster.save()

    # ------------------------------------------------------------------ invites and joining

    def create_invite(self, ttl_s: float) -> InviteToken:
        """A one-use token for a newcomer; remembered (as a digest) until it expires."""
        return self.roster.create_invite(self.mesh_id, self.addresses, ttl_s)

    def member_rows(self) -> list[dict[str, Any]]:
        """``mesh members list``: every member with its addresses, whether it is linked and
        who admitted it."""
        return self.roster.rows(self.links)

    def removed_rows(self) -> list[dict[str, Any]]:
        """``mesh members list``: every removed node, who removed it and when."""
        return self.roster.removed_rows()

    def remove_member(
        self,
        node: str,
        keep: Sequence[str] = (),
        dry_run: bool = False,
    ) -> RemovalReport:
        """Remove a member by node id (or a unique prefix of one), with the members it alone
        admitted (but ``keep``): signed, persisted, gossiped, their links closed and pins
        forgotten, the mesh secret rotated; they can come back only as new nodes. Raises
        ``MembershipError`` in words."""
        report = self.roster.remove(node, self.mesh_id, keep, dry_run)
        if not dry_run:
            for node_id in report.left:
                self._cut_off(node_id)
            self.sync.after_removal()
        return report

    def _cut_off(self, node_id: str) -> None:
        """A node that is no longer a member: close its link (its tunnel streams, split rank
        orders among them) and its open copy and ring-bridge connections, all at once; stop
        routing and dialing it."""
        conn = self.links.get(node_id)
        if conn is not None:
            conn.close(ErrorCode.AUTH_FAILED, "removed from the mesh")
        self.copy.server.drop_member(node_id)
        self.split.bridge.drop_member(node_id)
        log_peer_events(self.peers.on_leave(node_id, time.monotonic()))
        self.dialer.on_left(node_id)

    # ------------------------------------------------------------------ connections

    async def _on_connection(self, conn: PeerConnection) -> None:
        """Every new connection, ours or theirs: authenticate, then run the link."""
        peer_id = conn.peer_node_id or "?"
        try:
            async with asyncio.timeout(self.config.auth_timeout_s):
                admission = self.admission
                refusal = await (
                    admission.present(conn) if conn.is_client else admission.admit(conn)
                )
            counted = refusal  # an AuthFailure's value: removed, not_a_member, bad_invite, ...
        except (MeshError, TimeoutError) as exc:
            refusal = f"handshake failed: {type(exc).__name__}: {exc}"
            counted = "handshake_failed"
        if refusal:
            if not conn.is_client:  # a node we turned away (our own dial's refusal is theirs)
                self.endpoint.count_refusal(counted)
            log.warning(
                "membership with %s at %s refused: %s",
                short_id(peer_id),
                conn.peer_address,
                refusal,
            )
            # The reason travels in the CLOSE frame: a Denied message sent just before may be lost.
            conn.close(ErrorCode.AUTH_FAILED, f"auth failed: {refusal}"[:200])
            return
        if not conn.is_client and peer_id not in self.links:
            self.sync.broadcast()  # tell the others about a (maybe new) member
        await self._run_link(conn, peer_id)

    async def _run_link(self, conn: PeerConnection, peer_id: str) -> None:
        self.links[peer_id] = conn
        self.dialer.on_linked(peer_id)
        conn.on_stream = lambda stream: self.tunnel_server.handle(stream, peer_id)
        conn.mark_authenticated()
        self.split.notify()
        log.info("linked with %s at %s", short_id(peer_id), conn.peer_address)
        control = conn.control
        assert control is not None
        try:
            await control.send(self.sync.members_frame())
            if self.gossip.last_state is not None:
                await control.send(gossip_frame(self.gossip.last_state))
            while (frame := await control.recv()) is not None:
                if isinstance(frame, Control):
                    self.inbox.receive(peer_id, frame.kind, frame.body, time.monotonic())
        except MeshError as exc:
            log.info("link with %s ended: %s", short_id(peer_id), exc)
        finally:
            if self.links.get(peer_id) is conn:
                del self.links[peer_id]
                if conn.close_code == ErrorCode.SHUTDOWN:  # its Leave may not have made it
                    self._on_gossip(peer_id, Leave(node_id=peer_id))
                else:
                    log_peer_events(self.peers.on_disconnected(peer_id))
                self.split.notify()
            conn.close(ErrorCode.NO_ERROR, "link ended")

    def _on_gossip(self, peer_id: str, message: GossipMessage) -> None:
        now = time.monotonic()
        if isinstance(message, NodeState):
            if message.node_id == peer_id:  # a peer speaks only for itself
                log_peer_events(self.peers.on_state(message, now))
                self.split.notify()
                self.sync.on_state(peer_id, message, now)
        elif isinstance(message, Leave):
            if message.node_id == peer_id:
                log_peer_events(self.peers.on_leave(peer_id, now))
                self.dialer.on_left(peer_id)
        elif isinstance(message, Members):
            self.sync.on_members(peer_id, message, now)

    def _peer_upstream(self, node_id: str) -> PeerUpstream:
        async def connect() -> PeerConnection:
            conn = self.links.get(node_id)
            if conn is None or conn.is_closed:
                raise ConnectError(f"no live link to {short_id(node_id)}")
            return conn

        return PeerUpstream(
            name=node_id,
            connect=connect,
            self_id=self.node_id,
            on_begin=self.peers.begin_request,
            on_end=self.peers.end_request,
        )

    async def _ask_held(
        self, node_id: str, model: str, block_size: int, hashes: list[int], timeout_s: float
    ) -> held.Held | None:
        conn = self.links.get(node_id)
        if conn is None or conn.is_closed:
            return None
        return await held.ask(conn, model, block_size, hashes, timeout_s)

    # ------------------------------------------------------------------ background loops

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.append(task)

        def forget(done: asyncio.Task[None]) -> None:
            if done in self._tasks:
                self._tasks.remove(done)

        task.add_done_callback(forget)

    def local_state(self) -> NodeState:
        load = self.gossip.load
        return NodeState(
            node_id=self.node_id,
            version=self.config.version,
            gateway_url=self.config.gateway_url,
            addresses=self.addresses,
            models=[
                ModelAd(
                    name=info.id,
                    architecture=info.architecture,
                    parameters=info.parameters,
                    context_length=info.context_length,
                    capabilities=info.capabilities,
                    stages=self.split.stages(info.id),
                )
                for info in offered_models(self.local)
            ],
            queue_depth=int(load.get("queue_depth", 0)),
            # The workers' own count includes forwarded requests; without a probe, count those.
            in_flight=int(load.get("in_flight", self.tunnel_server.active)),
            tok_s=float(load.get("tok_s", 0.0)),
            cache=dict(load.get("cache", {})),  # prompt-cache digests (mesh/routing/)
            cache_stats=bounded(load.get("cache_stats", {})),  # the mesh-wide view
            track_record=track_record_ads(self.track_record.as_dict()),  # model="mesh"'s
            copy_port=self.copy.port,
            stored=stored_model_names(self.home),
            share_memory=self.split.offered_bytes,
            share_memory_used=self.split.host.used_bytes if self.split.host else 0,
            bridge_port=self.split.port,
            members_digest=self.sync.digest(),
        )

    # ------------------------------------------------------------------ discovery

    async def _start_discovery(self) -> None:
        hosts = []
        for address in self.addresses:
            with contextlib.suppress(AddressError):  # not HOST:PORT: nothing to advertise
                hosts.append(split_address(address)[0])
        self._discovery = LanDiscovery(
            node_id=self.node_id,
            mesh_id=self.mesh_id,
            port=self.endpoint.port,
            host_addresses=hosts,
            on_found=self._on_found,
        )
        await self._discovery.start()

    def _on_found(self, advert: Advert) -> None:
        if should_dial(
            advert,
            self_id=self.node_id,
            own_mesh_hash=mesh_hash(self.mesh_id),
            members=self.members.members,
            connected=self.links,
        ):
            log.info("found member %s on the LAN at %s", short_id(advert.node_id), advert.addresses)
            self.dialer.on_found(advert.node_id, advert.addresses)

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        """``GET /api/status``: this node and every peer it knows."""
        now = time.monotonic()
        me = self.local_state().model_dump(exclude={"type", "seq", "epoch"})
        me |= {"mesh_id": self.mesh_id, "members": len(self.members.members)}
        me["refused"] = dict(self.endpoint.refusals)  # strangers turned away, by reason
        me["ignored"] = dict(self.inbox.ignored.counts)  # peer messages dropped, by reason
        me["split"] = self.split.status()
        me["routing"] = self.directory.planner.status()  # mode, hedges, TTFT by node
        peers = self.peers.snapshot(now)
        for row in peers:
            conn = self.links.get(row["node_id"])
            row["connected"] = conn is not None
            if conn is not None and conn.rtt is not None:
                row["rtt_ms"] = round(conn.rtt * 1000, 2)
        return {"node": me, "peers": peers, "members": self.member_rows()}
