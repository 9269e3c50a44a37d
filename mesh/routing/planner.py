"""RoutePlanner: the mesh's routes for one request, ranked by cached prefix, load and RTT.

Three modes (``mesh up --routing``): ``cache`` (this issue: :mod:`mesh.routing.score` over
every node serving the model, this one included), ``today`` (local first, then the peer
table's load/RTT/session-hash order) and ``round-robin`` (every serving node in turn; a
baseline for the lab). With ``hedge="auto"`` the first route is hedged on the second
(:class:`gateway.hedge.HedgedUpstream`) after the first node's recent p95 TTFT (at least
``hedge_floor_s``), only while the backup node is idle and fewer than ``max_hedges`` hedges
run from here: a busy mesh gets no extra load.

The prompt's block hashes come from this node's own worker for the model (its tokenizer and
chat template: ``POST /v1/prompt_blocks``), once per request. A node that does not serve the
model has no tokenizer for it and ranks by load, RTT and session only: a text digest cannot
say how many tokens a prefix is, nor match the template's rendering, and forwarding the
tokenization to a peer costs a round trip on every request (see notes-routing.md).

A request without a session key gets one from its conversation (:func:`conversation_key`), so
that every entry node breaks a tie for the same conversation the same way. Without it a tie went
to whichever node the turn entered, and a conversation entering at random nodes left its turns'
caches on all of them, none holding the latest.

What gossip says of a cache is up to one interval (2 s) old, older than an agent's next turn,
and an answer goes out before its cache is committed. So a turn that continues a conversation
(it carries an earlier answer) first asks every node serving the model how much of its prompt
it holds now, a pending commit included (:mod:`mesh.routing.held`: one stream each, all at
once, ``held_question_s`` at most); an answer counts as fresh, silence leaves gossip's word.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.hedge import HedgedUpstream
from gateway.request import ChatRequest, Message
from gateway.upstream import ModelDirectory, Route, Upstream
from mesh.peers import PeerTable
from mesh.routing.held import Held
from mesh.routing.observed import Observed, TrackedUpstream
from mesh.routing.score import Candidate, Choice, Policy, rank
from worker.prompt_cache.digest import CacheDigest

log = logging.getLogger(__name__)

MODES = ("cache", "today", "round-robin")
HEDGE_MODES = ("off", "auto")


@dataclass(frozen=True)
class RoutingConfig:
    mode: str = "cache"
    hedge: str = "off"
    hedge_floor_s: float = 0.5
    max_hedges: int = 2
    max_routes: int = 3
    policy: Policy = field(default_factory=Policy)
    held_question_s: float = 0.25  # the deadline of the routing-time question (0: never ask)


# (node id, model, block size, block hashes, deadline s) -> what it holds now, or None
AskHeld = Callable[[str, str, int, list[int], float], Awaitable[Held | None]]


@dataclass
class _Prompt:
    hashes: list[int]
    tokens: int
    block_size: int


@dataclass
class RoutePlanner:
    local: ModelDirectory
    peers: PeerTable
    upstream_for: Callable[[str], Upstream]
    local_load: Callable[[], dict[str, Any]] = dict  # the load probe's last answer
    config: RoutingConfig = field(default_factory=RoutingConfig)
    clock: Callable[[], float] = time.monotonic
    observed: Observed = field(default_factory=Observed)
    ask_held: AskHeld | None = None  # a peer's answer to the routing-time question
    _turns: itertools.count = field(default_factory=itertools.count, repr=False)
    _parsed: tuple[str, CacheDigest | None] = field(default=("", None), repr=False)

    @property
    def self_id(self) -> str:
        return self.peers.self_id

    async def routes(self, request: ChatRequest) -> list[Route]:
        """Ranked routes, or [] to leave it to the directory's plain order (mode ``today``)."""
        if self.config.mode == "today":
            return []
        model, key = request.model, request.session_key
        if self.config.mode == "cache" and not key:
            key = conversation_key(request.messages)
        local = list(self.local.routes(model, key))
        peer_ids = self.peers.candidates(model, key)
        nodes = ([self.self_id] if local else []) + sorted(peer_ids)
        if len(nodes) < 2:
            return []
        self.observed.requests += 1
        turn = next(self._turns)
        if self.config.mode == "round-robin":
            shift = turn % len(nodes)
            order = nodes[shift:] + nodes[:shift]
            return self._build([Choice(n, 0.0, 0, "round-robin") for n in order], local)
        prompt = await self._prompt(request, local)
        held = await self._held_now(request, nodes, prompt, local)
        now = self.clock()
        candidates = [self._candidate(n, model, prompt, now, key, held.get(n)) for n in nodes]
        candidates = _with_known_rate(candidates)
        ranked = rank(
            candidates,
            prompt_tokens=prompt.tokens,
            now=now,
            session_key=key,
            turn=turn,
            prefer=self.self_id,
            policy=self.config.policy,
        )
        self.observed.remember(ranked[0].node_id, prompt.hashes, prompt.block_size, now, key)
        routes = self._build(ranked, local)
        if self.config.hedge == "auto" and len(routes) > 1:
            routes[0] = self._hedged(routes[0], routes[1], ranked[0])
        return routes

    async def _prompt(self, request: ChatRequest, local: list[Route]) -> _Prompt:
        blocks = None
        ask = getattr(local[0].upstream, "prompt_blocks", None) if local else None
        if ask is not None:
            blocks = await ask(request)
        if blocks is None:  # no tokenizer here: a rough size, no prefix
            chars = sum(len(m.content if isinstance(m.content, str) else str(m.content)) for m in request.messages)  # fmt: skip
            return _Prompt([], max(1, chars // 4), 64)
        return _Prompt(
            [int(h) for h in blocks["hashes"]],
            int(blocks.get("prompt_tokens", 1)),
            int(blocks.get("block_size", 64)),
        )

    async def _held_now(
        self, request: ChatRequest, nodes: list[str], prompt: _Prompt, local: list[Route]
    ) -> dict[str, Held]:
        """What each node says it holds of the prompt now, for a turn that continues a
        conversation; nodes that cannot say within the deadline are left out."""
        deadline = self.config.held_question_s
        if deadline <= 0 or not prompt.hashes or not continues(request.messages):
            return {}
        model, size, hashes = request.model, prompt.block_size, prompt.hashes

        async def one(node_id: str) -> Held | None:
            if node_id == self.self_id:
                ask = getattr(local[0].upstream, "prefix_held", None)
                return None if ask is None else Held.parse(await ask(size, hashes, deadline))
            if self.ask_held is None:
                return None
            return await self.ask_held(node_id, model, size, hashes, deadline)

        async def bounded(node_id: str) -> Held | None:
            try:
                async with asyncio.timeout(deadline):
                    return await one(node_id)
            except TimeoutError:
                return None

        answers = await asyncio.gather(*(bounded(n) for n in nodes))
        self.observed.held_questions += 1
        return {n: a for n, a in zip(nodes, answers, strict=True) if a is not None}

    def _candidate(
        self,
        node_id: str,
        model: str,
        prompt: _Prompt,
        now: float,
        session: str | None,
        held: Held | None = None,
    ) -> Candidate:
        routed = self.observed.routed_cached(node_id, prompt.hashes, prompt.block_size, now, session)  # fmt: skip
        running = self.observed.running[node_id]
        if node_id == self.self_id:
            load = self.local_load()
            digest = self._local_digest(load.get("cache", {}).get(model))
            candidate = Candidate(
                node_id,
                cached_tokens=max(_lookup(digest, prompt), routed),
                digest_at=now,
                queue_depth=int(load.get("queue_depth", 0)),
                running=max(running, int(load.get("in_flight", 0))),
                load_at=load.get("probed_at"),
                ttft_s=self.observed.ttft_s(node_id),
            )
        else:
            record = self.peers.peers[node_id]
            cached = _lookup(record.digest(model), prompt)
            candidate = Candidate(
                node_id,
                cached_tokens=max(cached, routed),
                # What we routed there ourselves is known now; the digest is as old as the state.
                digest_at=now if routed >= cached else record.last_seen,
                queue_depth=record.state.queue_depth,
                running=max(record.outstanding, record.state.in_flight),
                load_at=record.last_seen,
                ttft_s=self.observed.ttft_s(node_id),
                rtt_s=record.rtt_s,
            )
        return candidate if held is None else _heard_now(candidate, held, routed, running, now)

    def _local_digest(self, wire: Any) -> CacheDigest | None:
        if not isinstance(wire, str):
            return None
        if self._parsed[0] != wire:
            try:
                self._parsed = (wire, CacheDigest.from_wire(wire))
            except ValueError:
                return None
        return self._parsed[1]

    def _build(self, ranked: list[Choice], local: list[Route]) -> list[Route]:
        routes: list[Route] = []
        for number, choice in enumerate(ranked[: self.config.max_routes]):
            reason = choice.reason if number == 0 else "next"
            if choice.node_id == self.self_id:
                inner = local[0].upstream
                tracked = TrackedUpstream(inner, choice.node_id, self.observed, self.clock)
                routes.append(Route(upstream=tracked, kind="local", reason=reason))
                routes += local[1:]  # a second local route (rare) before the peers
            else:
                inner = self.upstream_for(choice.node_id)
                tracked = TrackedUpstream(inner, choice.node_id, self.observed, self.clock)
                routes.append(Route(upstream=tracked, kind="peer", peer=choice.node_id, reason=reason))  # fmt: skip
        return routes

    def _hedged(self, first: Route, second: Route, choice: Choice) -> Route:
        node = choice.node_id
        p95 = self.observed.p95_s(node)
        delay = max(self.config.hedge_floor_s, p95 if p95 is not None else 2 * choice.cost_s)
        backup_id = second.peer or self.self_id

        def allow() -> bool:
            # Off under overload: never more hedges than max_hedges, never onto a busy node.
            if self.observed.hedges_running >= self.config.max_hedges:
                return False
            return self.is_idle(backup_id)

        hedged = HedgedUpstream(
            first.upstream,
            second.upstream,
            delay,
            headers=(_headers(first), _headers(second)),
            allow=allow,
            on_hedge=self.observed.on_hedge,
        )
        return Route(upstream=hedged, kind=first.kind, peer=first.peer, reason=first.reason)

    def all_idle(self, model: str) -> bool:
        """Whether every node serving ``model`` (this one included) is idle now, as far as
        this node knows (its probe, gossip, what it sent itself): the vote then starts its
        samples at once as one batch instead of in waves."""
        peers = [r.node_id for r in self.peers.up() if r.serves(model)]
        nodes = ([self.self_id] if self.local.routes(model, None) else []) + peers
        return bool(nodes) and all(self.is_idle(n) for n in nodes)

    def is_idle(self, node_id: str) -> bool:
        if self.observed.running[node_id] > 0:
            return False
        if node_id == self.self_id:
            load = self.local_load()
            return int(load.get("queue_depth", 0)) == 0 and int(load.get("in_flight", 0)) == 0
        record = self.peers.peers.get(node_id)
        return record is not None and record.load == 0

    def status(self) -> dict[str, Any]:
        return {"mode": self.config.mode, "hedge": self.config.hedge} | self.observed.snapshot()


def _heard_now(candidate: Candidate, held: Held, routed: int, running: int, now: float) -> Candidate:  # fmt: skip
    """A candidate as the node's answer to the routing-time question says it is now: what it
    holds (a pending commit counted), its queue and its prefill rate; gossip's are older."""
    changes: dict[str, Any] = {"cached_tokens": max(held.tokens, routed), "digest_at": now}
    if held.queue_depth is not None:
        changes.update(queue_depth=held.queue_depth, load_at=now)
    if held.in_flight is not None:
        changes["running"] = max(running, held.in_flight)
    if held.prefill_tok_s is not None:
        changes["prefill_tok_s"] = held.prefill_tok_s
    if held.prefill_backlog is not None:
        changes["backlog_tokens"] = held.prefill_backlog
    if held.disk_tokens and held.tokens > routed:
        changes.update(restore_tokens=held.disk_tokens, restore_tok_s=held.restore_tok_s)
    return dataclasses.replace(candidate, **changes)


def _with_known_rate(candidates: list[Candidate]) -> list[Candidate]:
    """Nodes that did not say their prefill rate get the median of those that did (the same
    model, machines of a home mesh): a guess closer than the policy's fixed one, and the same
    for every node that did not say, so the comparison stays fair."""
    rates = [c.prefill_tok_s for c in candidates if c.prefill_tok_s is not None]
    if not rates or len(rates) == len(candidates):
        return candidates
    rate = statistics.median(rates)
    return [c if c.prefill_tok_s is not None else dataclasses.replace(c, prefill_tok_s=rate) for c in candidates]  # fmt: skip


def continues(messages: list[Message]) -> bool:
    """Whether a request continues a conversation: it carries an earlier answer."""
    return any(m.role in ("assistant", "tool") for m in messages)


def conversation_key(messages: list[Message]) -> str | None:
    """A stand-in session key, the same on every turn of a conversation: the hash of what comes
    before and in its first user message (the system prompt alone is usually shared by every
    conversation of an agent). Conversations that open alike still share it – and their first
    turn's prompt, so one node serving them all is what their caches want; a continuing turn is
    routed by what the nodes say they hold (:meth:`RoutePlanner._held_now`), the key only breaks
    ties among equals."""
    opening = hashlib.sha256()
    for message in messages:
        content = message.content if isinstance(message.content, str) else str(message.content)
        opening.update(f"{message.role}\x00{content[:8192]}\x00".encode())
        if message.role == "user" and message.content:
            return "conversation:" + opening.hexdigest()[:16]
    return None


def _headers(route: Route) -> dict[str, str]:
    return {"x-route": route.kind, "x-peer": route.peer or route.upstream.name}


def _lookup(digest: CacheDigest | None, prompt: _Prompt) -> int:
    if digest is None or digest.block_size != prompt.block_size or not prompt.hashes:
        return 0
    return digest.cached_tokens(prompt.hashes)
