"""Rank the nodes that serve a model for one prompt: cached prefix against load and RTT. Pure.

Each candidate's cost is an estimate of the seconds to its first token::

    cost = uncached_tokens / prefill_tok_s
           + (queued_batches + running_share * running) * per_request_s  +  rtt

The engine prefills its queue in batches of up to ``prefill_batch`` prompts (the worker's
``prefill_batch_size``), so a newcomer waits for ``ceil(queued / prefill_batch)`` batches, each
about one first token's time: counted one request each, seven prompts prefilling together
(a burst of agent turns) outweighed a 900-token cache hit in the routing lab. A queue depth
heard ``age`` seconds ago (``load_at``: gossip and the load probe run every 2 s) has had
``age / per_request_s`` batches served since. A running row does not make a newcomer wait: its
prefill runs before the batch's next decode step, so the rows decoding delay it by about a
step, which grows only slowly with the batch – each counts ``running_share`` of a request.

``uncached_tokens`` is the prompt less the prefix the node's cache digest holds (a digest older
than ``digest_ttl_s`` counts for nothing: the cache may have moved on); ``prefill_tok_s`` is the
node's measured prefill rate when it told us (its answer to the routing-time question), else a
mesh-wide guess; a prefix held only in its disk tier adds its restore (``restore_tokens`` at its
measured restore rate, else ten times its prefill rate); ``per_request_s`` is the node's recent
TTFT as this node saw it (else ``default_request_s``). Candidates within ``tie_s`` (or
``tie_ratio`` of the best cost) of the best tie; a session's rendezvous hash breaks
the tie (``sticky``), else a round-robin turn (``spread``), so new sessions and session-less
requests spread over idle nodes (but ``prefer``, this node, wins a tie no session decides); among
tied nodes those holding the most of the prompt come first. The first choice carries its reason,
whose first word says what decided: ``cache 18432/20100 (0.31s <= 2.10s elsewhere)`` (its cache
decided: its wait and the prefill of what it lacks beat the best node elsewhere), ``load (b1c2d3e4
holds 18432/20100 but 3.20s > 2.10s)`` (another node had more cached but was busier or farther),
``sticky``, ``local``, ``spread`` or ``only``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

# A restore from the disk tier against a prefill of the same tokens, until a node has measured
# its own: 0.82 s against 12 s for 3,000 SmolLM2 tokens here (bench/results/prompt-cache-disk.md).
RESTORE_SPEEDUP = 10.0


@dataclass(frozen=True, slots=True)
class Policy:
    prefill_tok_s: float = 1000.0  # a mesh-wide guess; only the ratio to per_request_s matters
    default_request_s: float = 1.0
    digest_ttl_s: float = 30.0
    tie_s: float = 0.05
    tie_ratio: float = 0.1
    running_share: float = 0.05
    prefill_batch: int = 8


@dataclass(frozen=True, slots=True)
class Candidate:
    """What is known of one node for this prompt. ``digest_at``: when its digest was heard."""

    node_id: str
    cached_tokens: int = 0
    digest_at: float | None = None
    queue_depth: int = 0
    running: int = 0  # rows generating there, ours included
    load_at: float | None = None  # when queue_depth was measured (None: now)
    ttft_s: float | None = None
    rtt_s: float | None = None
    prefill_tok_s: float | None = None  # its worker's measured rate (None: the policy's guess)
    backlog_tokens: int | None = None  # prompt tokens its queue prefills first (None: unknown)
    restore_tokens: int = 0  # of cached_tokens, those its disk tier must read back first
    restore_tok_s: float | None = None  # its measured restore rate (None: a multiple of prefill)


@dataclass(frozen=True, slots=True)
class Choice:
    node_id: str
    cost_s: float
    cached_tokens: int
    reason: str = ""


def affinity(session_key: str, node_id: str) -> int:
    """Rendezvous hash: each session prefers one node, stable while the node set changes."""
    return int.from_bytes(hashlib.sha256(f"{session_key}|{node_id}".encode()).digest()[:8], "big")


def usable_cached(candidate: Candidate, prompt_tokens: int, now: float, policy: Policy) -> int:
    """The cached tokens to count on: none from a stale digest, never the whole prompt (one
    token always runs)."""
    if candidate.digest_at is None or now - candidate.digest_at > policy.digest_ttl_s:
        return 0
    return max(0, min(candidate.cached_tokens, prompt_tokens - 1))


def cost(candidate: Candidate, prompt_tokens: int, now: float, policy: Policy) -> float:
    uncached = prompt_tokens - usable_cached(candidate, prompt_tokens, now, policy)
    per_request = candidate.ttft_s if candidate.ttft_s is not None else policy.default_request_s
    rate = candidate.prefill_tok_s or policy.prefill_tok_s
    if candidate.backlog_tokens is not None:  # the queue's work, as the node measured it now
        wait = candidate.backlog_tokens / rate
    else:
        batches = float(math.ceil(candidate.queue_depth / max(1, policy.prefill_batch)))
        if candidate.load_at is not None and per_request > 0:
            batches = max(0.0, batches - max(0.0, now - candidate.load_at) / per_request)
        wait = batches * per_request
    wait += policy.running_share * candidate.running * per_request
    restore = 0.0
    if candidate.restore_tokens and uncached < prompt_tokens:  # a disk hit: read, then prefill
        restore = candidate.restore_tokens / (candidate.restore_tok_s or RESTORE_SPEEDUP * rate)
    return uncached / rate + restore + wait + (candidate.rtt_s or 0.0)


def rank(
    candidates: Sequence[Candidate],
    *,
    prompt_tokens: int,
    now: float,
    session_key: str | None = None,
    turn: int = 0,
    prefer: str | None = None,
    policy: Policy = Policy(),
) -> list[Choice]:
    """Every candidate, best first; the first carries the reason it won. ``prefer`` (this
    node) wins a tie that no session decides: no hop for nothing, and load spreads the rest."""
    if not candidates:
        return []
    scored = sorted(
        (
            Choice(
                c.node_id,
                cost(c, prompt_tokens, now, policy),
                usable_cached(c, prompt_tokens, now, policy),
            )
            for c in candidates
        ),
        key=lambda s: (s.cost_s, s.node_id),
    )
    best = scored[0].cost_s
    margin = max(policy.tie_s, policy.tie_ratio * best)
    tied = [s for s in scored if s.cost_s - best <= margin]
    rest = scored[len(tied) :]
    # A tie goes to the nodes holding the most of the prompt first: a few blocks cached are
    # worth less than the tie's margin, but they are the conversation's, and its next turn
    # finds more there.
    most = max(s.cached_tokens for s in tied)
    rest = [s for s in tied if s.cached_tokens < most] + rest
    tied = [s for s in tied if s.cached_tokens == most]
    if session_key:
        tied.sort(key=lambda s: -affinity(session_key, s.node_id))
        breaker = "sticky"
    elif prefer is not None and any(s.node_id == prefer for s in tied):
        tied.sort(key=lambda s: s.node_id != prefer)
        breaker = "local"
    else:
        shift = turn % len(tied)
        tied = tied[shift:] + tied[:shift]
        breaker = "spread"
    first = tied[0]
    others = [s for s in scored if s is not first]
    reason = _reason(first, others, len(tied) > 1, breaker, prompt_tokens)
    first = Choice(first.node_id, first.cost_s, first.cached_tokens, reason)
    return [first, *tied[1:], *rest]


def _reason(first: Choice, others: list[Choice], tie: bool, breaker: str, prompt: int) -> str:
    """The first word says what decided (the lab counts it); a cache or load decision says the
    rule's numbers: a cache target wins only when its wait and the prefill of what it lacks cost
    less than the best node without its cache (estimated seconds to the first token)."""
    if not others:
        return "only"
    holder = max(others, key=lambda o: (o.cached_tokens, -o.cost_s))
    if first.cached_tokens > holder.cached_tokens:
        elsewhere = min(o.cost_s for o in others)
        than = "<=" if first.cost_s <= elsewhere else "~"  # "~": a tie the cache decided
        return f"cache {first.cached_tokens}/{prompt} ({first.cost_s:.2f}s {than} {elsewhere:.2f}s elsewhere)"  # fmt: skip
    if holder.cached_tokens > first.cached_tokens:
        return (
            f"load ({holder.node_id[:8]} holds {holder.cached_tokens}/{prompt} but"
            f" {holder.cost_s:.2f}s > {first.cost_s:.2f}s)"
        )
    return breaker if tie else "load"
