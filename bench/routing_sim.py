"""Routing by cached prefix, simulated: which node's prompt cache serves each turn of replayed
agent sessions under today's routing, round robin, the session hash and the new planner.

Not the lab run of issue 25 (no processes, no TTFT): it drives the real planner
(``mesh.routing.planner.RoutePlanner``), the real digests (``worker.prompt_cache.digest``) and peer
table, with each node's prompt cache modelled as an LRU of token sequences (as
``worker.prompt_cache.store``: the longest shared prefix is served, the finished turn is stored).
12 sessions of 10 turns, one turn per session per round, in random order, each entering at a
random node; digests reach peers one round late (gossip); node 2 stops after round 4 and comes
back empty after round 6. Prints and writes bench/results/routing-sim.md.

    .venv/bin/python bench/routing_sim.py [--seed N]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
from collections import OrderedDict
from pathlib import Path

from gateway.request import ChatRequest, Message
from gateway.testing import ScriptedUpstream, text_script
from gateway.upstream import ModelInfo, StaticDirectory
from mesh.gossip import ModelAd, NodeState
from mesh.peers import PeerTable
from mesh.routing.planner import RoutePlanner, RoutingConfig
from mesh.routing.score import affinity
from worker.prompt_cache.digest import CacheDigest, block_hashes, common_prefix

NODES = ["n0", "n1", "n2"]
SESSIONS, TURNS, ENTRIES = 12, 10, 16  # ENTRIES: prompt-cache entries per node


Session = list[tuple[list[int], list[int]]]  # each turn: (its prompt, the answer generated)


def make_sessions(rng: random.Random) -> list[Session]:
    """Each session: its turns, (prompt, answer). A system prompt + tools shared by all (an agent
    harness's ~3k tokens), then a task; each next prompt is the last one + the answer the node
    generated (and cached) + a tool result, as in any agent loop."""
    system = [rng.randrange(1, 50_000) for _ in range(3000)]
    sessions = []
    for _ in range(SESSIONS):
        prompt = system + [rng.randrange(1, 50_000) for _ in range(rng.randrange(100, 400))]
        turns = []
        for _ in range(TURNS):
            answer = [rng.randrange(1, 50_000) for _ in range(rng.randrange(50, 300))]
            turns.append((list(prompt), answer))
            prompt += answer + [rng.randrange(1, 50_000) for _ in range(rng.randrange(100, 600))]
        sessions.append(turns)
    return sessions


def ceiling(sessions: list[Session]) -> float:
    """The best any routing can do: each turn finds all of its previous turn (prompt and
    answer) cached, and the shared system prompt is computed once."""
    total = sum(len(p) for turns in sessions for p, _ in turns)
    fresh = 3000 + sum(len(turns[0][0]) - 3000 for turns in sessions)
    for turns in sessions:
        for (before, answer), (prompt, _) in itertools.pairwise(turns):
            fresh += len(prompt) - len(before) - len(answer)
    return 1 - fresh / total


class Node:
    def __init__(self, name: str) -> None:
        self.name = name
        self.entries: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self.key = 0
        self.up = True

    def serve(self, prompt: list[int], answer: list[int]) -> int:
        best, best_key = 0, None
        for key, tokens in self.entries.items():
            n = min(common_prefix(tokens, prompt), len(prompt) - 1)
            if n > best:
                best, best_key = n, key
        if best_key is not None:
            self.entries.move_to_end(best_key)
        turn = prompt + answer
        for key, tokens in list(self.entries.items()):  # entries the new one extends
            if common_prefix(tokens, turn) == len(tokens):
                del self.entries[key]
        self.entries[self.key] = tuple(turn)
        self.key += 1
        while len(self.entries) > ENTRIES:
            self.entries.popitem(last=False)
        return best

    def digest(self) -> str:
        return CacheDigest.of_entries(list(reversed(self.entries.values()))).to_wire()


class Tokenizing(ScriptedUpstream):
    prompt: tuple[int, ...] = ()  # set before each routing call

    async def prompt_blocks(self, request):
        return {"block_size": 64, "prompt_tokens": len(self.prompt), "hashes": block_hashes(self.prompt)}  # fmt: skip


async def run(mode: str, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    sessions = make_sessions(random.Random(seed))
    nodes = {n: Node(n) for n in NODES}
    gossiped = {n: CacheDigest().to_wire() for n in NODES}
    planners: dict[str, RoutePlanner] = {}
    for n in NODES:
        local = StaticDirectory()
        local.add(ModelInfo(id="m"), Tokenizing(scripts=[text_script("x")], name="local"))
        planners[n] = RoutePlanner(
            local,
            PeerTable(n),
            lambda node_id: ScriptedUpstream(scripts=[text_script("x")], name=node_id),
            lambda n=n: {"cache": {"m": gossiped[n]}},
            RoutingConfig(mode="cache"),
            clock=lambda: now,
        )
    prompt_total = cached_total = lost = 0
    now = 0.0
    for round_ in range(TURNS):
        now = float(round_ * 10)
        nodes["n2"].up = not (4 <= round_ < 7)
        if round_ == 7:
            nodes["n2"].entries.clear()  # restarted: an empty cache
        up = [n for n in NODES if nodes[n].up]
        for n in up:  # last round's digests arrive now (gossip lags a round)
            for m in up:
                if m != n:
                    state = NodeState(node_id=m, seq=round_ + 1, models=[ModelAd(name="m")], cache={"m": gossiped[m]})  # fmt: skip
                    planners[n].peers.on_state(state, now)
            for gone in set(planners[n].peers.peers) - set(up):
                planners[n].peers.on_leave(gone, now)
        order = list(range(SESSIONS))
        rng.shuffle(order)
        for s in order:
            prompt, answer = sessions[s][round_]
            entry = rng.choice(up)
            target = await choose(mode, entry, prompt, f"s{s}", up, planners, round_ * SESSIONS + s)
            if target not in up:
                lost += 1
                continue
            cached_total += nodes[target].serve(prompt, answer)
            prompt_total += len(prompt)
        gossiped = {n: nodes[n].digest() for n in NODES}
    return {
        "cached_ratio": cached_total / prompt_total,
        "prefill_tokens": prompt_total - cached_total,
        "prompt_tokens": prompt_total,
        "lost": lost,
    }


async def choose(mode, entry, prompt, session, up, planners, turn) -> str:
    if mode == "today":
        return entry  # every node serves the model: local first
    if mode == "round-robin":
        return up[turn % len(up)]
    if mode == "session-hash":  # today's rendezvous hash (an entry node without the model)
        return max(up, key=lambda n: affinity(session, n))
    planner = planners[entry]
    planner.local.routes("m")[0].upstream.prompt = tuple(prompt)
    request = ChatRequest(model="m", messages=[Message(role="user", content="x")])
    if mode == "cache+session":
        request.session_key = session
    routes = await planner.routes(request)
    return routes[0].peer or entry if routes else entry


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=25)
    args = parser.parse_args()
    modes = ["today", "round-robin", "session-hash", "cache", "cache+session"]
    rows = {mode: asyncio.run(run(mode, args.seed)) for mode in modes}
    lines = [
        f"# Routing by prefix, simulated (bench/routing_sim.py, seed {args.seed})",
        "",
        f"{SESSIONS} sessions x {TURNS} turns, 3 nodes, random entry node, node 2 down for rounds 4-6"
        f" and back empty; {ENTRIES} cache entries a node; digests one round late. Each prompt is"
        " the last one + the answer generated for it + a tool result.",
        "",
        f"Ceiling (every turn finds its whole previous turn cached, the system prompt computed"
        f" once): {ceiling(make_sessions(random.Random(args.seed))):.3f}.",
        "",
        "| routing | cached/prompt tokens | prefill tokens | lost |",
        "|---|---|---|---|",
    ]
    for mode, r in rows.items():
        lines.append(f"| {mode} | {r['cached_ratio']:.3f} | {r['prefill_tokens']} | {r['lost']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(__file__).parent / "results" / "routing-sim.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
