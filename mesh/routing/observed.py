"""What this node saw of its own routed requests: TTFT by node, rows running, hedges. Pure but
for :class:`TrackedUpstream`, the thin wrapper that feeds it.

TTFT samples are kept per node (the last ``window``), so a slow node shows up as slow from
here (its queue, its link, its CPU) whatever it says of itself. Prompts routed to a node are
remembered for ``remember_s``: its cache will hold them once the request ends, well before its
next digest arrives by gossip, so the next turn of that conversation finds them there. A prompt
routed with a session key is found again only by that session: otherwise the first turn of one
session, placed by its session hash, would pull the first turns of every other session that
shares its system prompt onto the same node (the memory outbidding the hash that spreads new
sessions), before any digest could show that the other nodes hold that prompt too.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from gateway.events import Error, Event
from gateway.request import ChatRequest
from gateway.router import CommitTracker
from gateway.upstream import StartHold, Upstream, close_stream


@dataclass
class Observed:
    window: int = 32
    remember_s: float = 20.0
    ttft: dict[str, deque[float]] = field(default_factory=dict)
    running: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    # node -> (when, block hashes, block size, session key) of prompts routed there lately
    routed: dict[str, deque[tuple[float, frozenset[int], int, str | None]]] = field(
        default_factory=dict
    )
    hedges: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    hedges_running: int = 0
    requests: int = 0
    held_questions: int = 0  # continuing turns that asked the nodes what they hold now

    def on_ttft(self, node_id: str, seconds: float) -> None:
        self.ttft.setdefault(node_id, deque(maxlen=self.window)).append(seconds)

    def ttft_s(self, node_id: str) -> float | None:
        """The node's median TTFT lately, as seen from here (None: no samples)."""
        samples = self.ttft.get(node_id)
        return statistics.median(samples) if samples else None

    def p95_s(self, node_id: str, min_samples: int = 4) -> float | None:
        samples = self.ttft.get(node_id)
        if not samples or len(samples) < min_samples:
            return None
        ordered = sorted(samples)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]

    def remember(
        self,
        node_id: str,
        hashes: Sequence[int],
        block_size: int,
        now: float,
        session: str | None = None,
    ) -> None:
        if hashes:
            kept = self.routed.setdefault(node_id, deque(maxlen=64))
            kept.append((now, frozenset(hashes), block_size, session))

    def routed_cached(
        self,
        node_id: str,
        hashes: Sequence[int],
        block_size: int,
        now: float,
        session: str | None = None,
    ) -> int:
        """Tokens of a prompt (its block hashes) that prompts routed to ``node_id`` lately share;
        with a ``session``, only that session's prompts count."""
        best = 0
        for at, seen, size, key in self.routed.get(node_id, ()):
            if now - at > self.remember_s or size != block_size:
                continue
            if session is not None and key != session:
                continue
            for depth in range(len(hashes), best, -1):
                if hashes[depth - 1] in seen:
                    best = depth
                    break
        return best * block_size

    def on_hedge(self, what: str) -> None:
        self.hedges[what] += 1
        if what == "started":
            self.hedges_running += 1
        elif self.hedges_running > 0:
            self.hedges_running -= 1

    def snapshot(self) -> dict:
        return {
            "requests": self.requests,
            "held_questions": self.held_questions,
            "hedges": dict(self.hedges),
            "ttft_ms": {n: round(1000 * (self.ttft_s(n) or 0.0), 1) for n in self.ttft},
        }


@dataclass
class TrackedUpstream(Upstream):
    """``inner``, counting its rows running on ``node_id`` and timing its first content."""

    inner: Upstream
    node_id: str
    observed: Observed
    clock: Callable[[], float] = time.monotonic

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    @property
    def retryable(self) -> bool:  # type: ignore[override]
        return self.inner.retryable

    @property
    def start_hold(self) -> StartHold | None:
        return self.inner.start_hold

    async def count_tokens(self, request: ChatRequest) -> int | None:
        return await self.inner.count_tokens(request)

    async def aclose(self) -> None:
        """Nothing of its own: ``inner`` belongs to whoever made it (the directory)."""

    async def stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        commit = CommitTracker(streaming=True)
        started = self.clock()
        self.observed.running[self.node_id] += 1
        source = self.inner.stream(request)
        try:
            async for event in source:
                if not commit.committed and commit.feed(event) and not isinstance(event, Error):
                    self.observed.on_ttft(self.node_id, self.clock() - started)
                yield event
        finally:
            self.observed.running[self.node_id] -= 1
            await close_stream(source)
