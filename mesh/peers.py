"""The peer table: what this node knows about every other node, and which one to ask. Pure.

Fed gossip (``on_state``, ``on_leave``, ``on_rtt``), connection facts (``on_disconnected``) and
the clock (``tick``); answers ``candidates(model, session_key)``. Every method takes ``now``
explicitly so tests drive time without sleeping.

Peer lifecycle: UP (heard from within ``down_after_s``) → DOWN (missed heartbeats or the tunnel
dropped: not routed to) → dropped (silent for ``drop_after_s``) . A ``Leave`` drops at once.
The models of a dropped peer are remembered for ``forget_models_after_s``: until then a request
for one is "no server right now" (503, retry later), not "no such model" (404, never again).
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import logging
from dataclasses import dataclass, field

from mesh.gossip import ModelAd, NodeState
from mesh.identity import short_id
from worker.prompt_cache.digest import CacheDigest

log = logging.getLogger(__name__)


class PeerStatus(enum.Enum):
    UP = "up"
    DOWN = "down"


@dataclass(frozen=True, slots=True)
class PeerJoined:
    node_id: str


@dataclass(frozen=True, slots=True)
class PeerWentDown:
    node_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class PeerDropped:
    node_id: str
    reason: str


PeerEvent = PeerJoined | PeerWentDown | PeerDropped


@dataclass
class PeerRecord:
    node_id: str
    state: NodeState
    status: PeerStatus
    last_seen: float
    rtt_s: float | None = None
    outstanding: int = 0  # requests this node has sent there and not yet seen end
    # model -> (wire form, parsed): the peer's prompt-cache digest, parsed once per change
    _digests: dict[str, tuple[str, CacheDigest]] = field(default_factory=dict, repr=False)

    @property
    def load(self) -> int:
        return self.state.queue_depth + self.state.in_flight + self.outstanding

    def serves(self, model: str) -> bool:
        return any(ad.name == model for ad in self.state.models)

    def digest(self, model: str) -> CacheDigest | None:
        """What the peer's prompt cache for ``model`` holds, as it last said (None: unknown)."""
        wire = self.state.cache.get(model)
        if wire is None:
            return None
        known = self._digests.get(model)
        if known is None or known[0] != wire:
            try:
                known = (wire, CacheDigest.from_wire(wire))
            except ValueError:
                log.debug("peer %s sent a bad cache digest", short_id(self.node_id))
                return None
            self._digests[model] = known
        return known[1]

    def _set_status(self, status: PeerStatus) -> None:
        if status is not self.status:
            log.info("peer %s %s -> %s", short_id(self.node_id), self.status.value, status.value)
            self.status = status


def affinity(session_key: str, node_id: str) -> int:
    """Rendezvous hash: each session prefers one node, stable while the node set changes."""
    return int.from_bytes(hashlib.sha256(f"{session_key}|{node_id}".encode()).digest()[:8], "big")


@dataclass
class PeerTable:
    """Peers by node id. ``rtt_bucket_s`` makes RTTs within one bucket tie, so affinity decides."""

    self_id: str
    down_after_s: float = 6.0
    drop_after_s: float = 30.0
    rtt_bucket_s: float = 0.02
    forget_models_after_s: float = 300.0
    peers: dict[str, PeerRecord] = field(default_factory=dict)
    # model -> when the last peer that served it was dropped (left, or silent too long)
    gone_models: dict[str, float] = field(default_factory=dict)
    _turn: int = field(default=0, repr=False)  # round robin among tied peers (no session key)

    # ----------------------------------------------------------------- inputs

    def on_state(self, state: NodeState, now: float) -> list[PeerEvent]:
        if state.node_id == self.self_id:
            return []
        record = self.peers.get(state.node_id)
        if record is None:
            self.peers[state.node_id] = PeerRecord(state.node_id, state, PeerStatus.UP, now)
            return [PeerJoined(state.node_id)]
        if record.state.epoch == state.epoch and state.seq <= record.state.seq:
            return []  # stale or duplicate copy
        record.state = state
        record.last_seen = now
        events: list[PeerEvent] = []
        if record.status is PeerStatus.DOWN:
            events.append(PeerJoined(state.node_id))
        record._set_status(PeerStatus.UP)
        return events

    def on_rtt(self, node_id: str, rtt_s: float) -> None:
        record = self.peers.get(node_id)
        if record is not None and rtt_s >= 0:
            # Smooth like TCP's SRTT so one slow sample does not reshuffle routing.
            record.rtt_s = rtt_s if record.rtt_s is None else 0.875 * record.rtt_s + 0.125 * rtt_s

    def on_leave(self, node_id: str, now: float) -> list[PeerEvent]:
        record = self.peers.pop(node_id, None)
        if record is None:
            return []
        self._remember_models(record, now)
        return [PeerDropped(node_id, "left")]

    def on_disconnected(self, node_id: str) -> list[PeerEvent]:
        """The tunnel to the peer broke: stop routing to it until it is heard from again."""
        record = self.peers.get(node_id)
        if record is None or record.status is PeerStatus.DOWN:
            return []
        record._set_status(PeerStatus.DOWN)
        # A reconnect re-sends the state; accept it even if the epoch and seq are unchanged.
        record.state = record.state.model_copy(update={"seq": -1})
        return [PeerWentDown(node_id, "disconnected")]

    def tick(self, now: float) -> list[PeerEvent]:
        events: list[PeerEvent] = []
        for node_id, record in list(self.peers.items()):
            silent = now - record.last_seen
            if silent >= self.drop_after_s:
                del self.peers[node_id]
                self._remember_models(record, now)
                events.append(PeerDropped(node_id, "silent"))
            elif silent >= self.down_after_s and record.status is PeerStatus.UP:
                record._set_status(PeerStatus.DOWN)
                events.append(PeerWentDown(node_id, "missed heartbeats"))
        return events

    def _remember_models(self, record: PeerRecord, now: float) -> None:
        for ad in record.state.models:
            self.gone_models[ad.name] = now
        for model, since in list(self.gone_models.items()):
            if now - since >= self.forget_models_after_s:
                del self.gone_models[model]

    def begin_request(self, node_id: str) -> None:
        if (record := self.peers.get(node_id)) is not None:
            record.outstanding += 1

    def end_request(self, node_id: str) -> None:
        if (record := self.peers.get(node_id)) is not None and record.outstanding > 0:
            record.outstanding -= 1

    # ----------------------------------------------------------------- queries

    def up(self) -> list[PeerRecord]:
        return [r for r in self.peers.values() if r.status is PeerStatus.UP]

    def candidates(self, model: str, session_key: str | None = None) -> list[str]:
        """Node ids of UP peers serving ``model``: least load, then RTT bucket; peers still tied
        go by session affinity for a session key, else round robin (one turn per call), so
        idle peers share the requests that carry no session."""

        def tier(record: PeerRecord) -> tuple[int, int]:
            rtt = record.rtt_s if record.rtt_s is not None else 0.0
            return (record.load, int(rtt / self.rtt_bucket_s))

        serving = [r for r in self.up() if r.serves(model)]
        if session_key:
            ranked = sorted(serving, key=lambda r: (*tier(r), -affinity(session_key, r.node_id)))
            return [r.node_id for r in ranked]
        turn, self._turn = self._turn, self._turn + 1
        out: list[str] = []
        for _, tied in itertools.groupby(
            sorted(serving, key=lambda r: (*tier(r), r.node_id)), tier
        ):
            ids = [r.node_id for r in tied]
            shift = turn % len(ids)
            out += ids[shift:] + ids[:shift]
        return out

    def recently_served(self, model: str, now: float) -> bool:
        """Whether a peer served ``model`` lately: one that is down now (not dropped yet), or one
        dropped less than ``forget_models_after_s`` ago."""
        if any(record.serves(model) for record in self.peers.values()):
            return True
        since = self.gone_models.get(model)
        return since is not None and now - since < self.forget_models_after_s

    def models(self) -> dict[str, tuple[ModelAd, str]]:
        """Every model served by an UP peer → (its ad, the first peer seen serving it)."""
        out: dict[str, tuple[ModelAd, str]] = {}
        for record in self.up():
            for ad in record.state.models:
                out.setdefault(ad.name, (ad, record.node_id))
        return out

    def snapshot(self, now: float) -> list[dict]:
        """Plain rows for ``/api/status``."""
        return [
            {
                "node_id": r.node_id,
                "state": r.status.value,
                "addresses": r.state.addresses,
                "gateway_url": r.state.gateway_url,
                "version": r.state.version,
                "models": [ad.model_dump() for ad in r.state.models],
                "queue_depth": r.state.queue_depth,
                "in_flight": r.state.in_flight,
                "outstanding": r.outstanding,
                "tok_s": r.state.tok_s,
                "cache_blocks": {m: len(d) for m in r.state.cache if (d := r.digest(m))},
                # each model's prompt cache in brief (mesh/cache_stats.py; {}: an older peer)
                "cache_stats": {m: s.model_dump() for m, s in r.state.cache_stats.items()},
                # memory offered for ranks of split models, and what they use (console, status)
                "share_memory": r.state.share_memory,
                "share_memory_used": r.state.share_memory_used,
                "rtt_ms": None if r.rtt_s is None else round(r.rtt_s * 1000, 2),
                "last_seen_s": round(max(0.0, now - r.last_seen), 2),
            }
            for r in sorted(self.peers.values(), key=lambda r: r.node_id)
        ]
