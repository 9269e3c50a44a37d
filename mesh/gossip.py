"""Gossip: what a node tells its peers about itself, and when. Sans-IO.

Each node publishes a :class:`NodeState` when it changes and at least every ``interval_s``
(the heartbeat); peers that miss heartbeats are marked down by the :class:`~mesh.peers.PeerTable`.
A clean shutdown sends :class:`Leave`. ``Members`` spreads the member list's signed facts so a
node that joined through one member can reach the rest. (Round-trip times come from the tunnel's own
keep-alive pings, not from gossip.)

Messages travel as one orjson object each (the service puts them on a tunnel stream).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mesh.cache_stats import CacheStatsAd
from mesh.errors import GossipDecodeError, UnknownGossipType
from mesh.membership.codec import MessageCodec
from mesh.membership.facts import Admission, Tombstone
from mesh.membership.members import Member
from mesh.track_records import TrackRecordAd

DEFAULT_INTERVAL_S = 2.0


class StageAd(BaseModel):
    """One stage of a split model: rank ``rank`` runs layers ``[start, end)`` on ``node_id``."""

    rank: int
    node_id: str
    start: int
    end: int


class ModelAd(BaseModel):
    """One model a node serves locally, as advertised to the mesh."""

    name: str
    architecture: str = "unknown"
    parameters: int | None = None
    context_length: int | None = None
    capabilities: dict[str, Any] = Field(default_factory=dict)
    # A model split over several nodes (mesh/split/): its stages in layer order; empty: whole.
    stages: list[StageAd] = Field(default_factory=list)


class NodeState(BaseModel):
    """A node's public state. Within one ``epoch`` (one process run) a higher ``seq`` wins."""

    model_config = ConfigDict(extra="ignore")  # newer peers may add fields

    type: Literal["state"] = "state"
    node_id: str
    epoch: str = ""
    seq: int = 0
    version: str = ""
    gateway_url: str = ""
    addresses: list[str] = Field(default_factory=list)
    models: list[ModelAd] = Field(default_factory=list)
    queue_depth: int = 0
    in_flight: int = 0
    tok_s: float = 0.0
    # Peer copy (optional, so older peers' states still decode): the TCP port of this node's
    # copy server and the models in its store (served or not).
    copy_port: int | None = None
    stored: list[str] = Field(default_factory=list)
    # Split serving (optional, as above): bytes of memory this node offers to ranks of models
    # split over the mesh (``mesh up --share-memory GB``; 0: none), what its ranks use of it
    # now, and the TCP port of its ring bridge (mesh/split/bridge.py).
    share_memory: int = 0
    share_memory_used: int = 0
    bridge_port: int | None = None
    # Routing by prefix (optional, as above): model name → the digest of what its worker's
    # prompt cache holds (worker/prompt_cache/digest.py, wire form). Refreshed with the load probe,
    # so at most once per gossip interval; bounded by the digest's own bound.
    cache: dict[str, str] = Field(default_factory=dict)
    # The mesh-wide view (optional, as above): model name → its prompt cache in brief (memory
    # and disk tier bytes, prefixes, hit rate, budget; mesh/cache_stats.py). Refreshed with the
    # load probe; at most ``MAX_MODELS`` entries of a few numbers each.
    cache_stats: dict[str, CacheStatsAd] = Field(default_factory=dict)
    # model="mesh"'s track record (optional, as above): model name → its counts in this node's
    # pools; every node sums its own and its peers' to order and collapse its pools.
    track_record: dict[str, TrackRecordAd] = Field(default_factory=dict)
    # Signed membership (optional, as above): the digest of the member facts this node holds.
    # A peer whose digest differs is sent ours: members that missed a change converge.
    members_digest: str = ""

    def content(self) -> dict:
        """Everything but ``seq``: what decides whether a change is worth publishing now."""
        return self.model_dump(exclude={"seq", "epoch"})


class Leave(BaseModel):
    type: Literal["leave"] = "leave"
    node_id: str


class Members(BaseModel):
    """The member list's signed facts (:mod:`mesh.membership.facts`) and the members'
    addresses. A receiver takes only what its ledger verifies; ``members`` entries are dialing
    hints for nodes the facts admit, nothing more. ``removed`` is for nodes of the previous
    version (unsigned: upgraded nodes ignore it). The mesh secret's generation and digest tell
    a peer that its secret is older than ours (then we send ours on that link)."""

    type: Literal["members"] = "members"
    members: list[Member] = Field(default_factory=list)
    removed: dict[str, float] = Field(default_factory=dict)  # node id → when it was removed
    admissions: list[Admission] = Field(default_factory=list)
    tombstones: list[Tombstone] = Field(default_factory=list)
    secret_generation: int = 0
    secret_digest: str = ""


GossipMessage = NodeState | Leave | Members
GOSSIP_TYPES = frozenset({"state", "leave", "members"})


# Discriminated by ``type``: a bad message is reported against its own schema only.
_CODEC: MessageCodec[GossipMessage] = MessageCodec(
    Annotated[GossipMessage, Field(discriminator="type")], GossipDecodeError, "gossip message"
)


def gossip_from_dict(data: dict) -> GossipMessage:
    """Parse one gossip message. ``UnknownGossipType`` for a type this version does not know (a
    newer peer's: ignore it), ``GossipDecodeError`` for a known type that does not validate."""
    if isinstance(data, dict) and not (
        isinstance(kind := data.get("type"), str) and kind in GOSSIP_TYPES
    ):
        raise UnknownGossipType(f"unknown gossip type {str(kind)[:32]!r}")
    return _CODEC.from_dict(data)


@dataclass
class GossipPublisher:
    """Decides when this node's state goes out: on change, else once per heartbeat interval.

    ``min_gap_s`` bounds how often changes alone can trigger a publication (queue depth moves
    with every request; peers need the trend, not every step).
    """

    node_id: str
    epoch: str = field(default_factory=lambda: secrets.token_hex(4))
    interval_s: float = DEFAULT_INTERVAL_S
    min_gap_s: float = 0.25
    seq: int = 0
    _last_content: dict | None = field(default=None, init=False)
    _last_sent_at: float | None = field(default=None, init=False)

    def poll(self, state: NodeState, now: float) -> NodeState | None:
        """The state to publish now, with its ``seq`` set, or None if nothing is due."""
        content = state.content()
        last = self._last_sent_at
        changed = content != self._last_content
        since = float("inf") if last is None else now - last  # never sent: due at once
        due = since >= self.interval_s
        if not due and not (changed and since >= self.min_gap_s):
            return None
        self.seq += 1
        self._last_content = content
        self._last_sent_at = now
        return state.model_copy(
            update={"seq": self.seq, "node_id": self.node_id, "epoch": self.epoch}
        )
