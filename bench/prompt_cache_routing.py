"""Benchmark: a conversation's next turn entering at the *other* member (issue 45's routing case).

Two real ``mesh up`` members on loopback serve the same model (SmolLM2 by default), no session
header. Twenty conversations, as a chat client sends them: a shared agent system prompt, a first
user message (most carry a note of their own; some open with the same words – a harness's fixed
first turn), the model's answer, then turn 2 (the whole conversation again plus a new question),
sent the moment turn 1's answer arrived – at the member turn 1 did *not* enter. What counts is
the share of turn 2's prompt the serving worker found in its prompt cache
(``usage.prompt_tokens_details.cached_tokens``), and the route reason it carried.

Turn 2's best possible share is its prompt less the new question (and the template's tokens
around it): reported per conversation as the ceiling.

    python bench/prompt_cache_routing.py [--model DIR] [--conversations 20] [--routing cache]

Writes ``bench/results/prompt-cache-routing.md`` (``--no-write``: print only).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "prompt-cache-routing.md"

SYSTEM = (
    "You are a careful assistant for a small software team. Answer briefly and concretely; "
    "when you are unsure, say what you would check first."
)
SHARED_OPENINGS = [
    "Which file holds the tests? Here is the tree:\n"
    + "\n".join(f"src/pkg/module_{i:02d}.py\ntests/test_module_{i:02d}.py" for i in range(40)),
    "Review this plan and list its risks:\n"
    + " ".join(
        f"Step {i}: move service {i} to the new cluster, then drain the old one." for i in range(30)
    ),
]
WORDS = (
    "cache mesh node worker token prompt prefix route gossip digest member invite quic stream "
    "commit batch prefill decode budget memory disk restart session turn agent model answer"
).split()
FOLLOW_UPS = [
    "Why that one?",
    "What would you check next?",
    "Say it in one line.",
    "Any other option?",
    "What could go wrong?",
    "How sure are you?",
    "Give an example.",
    "And after that?",
]


def conversations(count: int, seed: int = 7) -> list[str]:
    """The first user message of each conversation: three of every group of ten open alike."""
    rng = random.Random(seed)
    openings = []
    for index in range(count):
        if index % 10 < 3:
            openings.append(SHARED_OPENINGS[(index // 10) % len(SHARED_OPENINGS)])
        else:
            note = " ".join(rng.choice(WORDS) for _ in range(220))
            openings.append(f"Note {index}: {note}\nWhat is this note about?")
    return openings


@dataclass
class Member:
    name: str
    home: Path
    process: subprocess.Popen[bytes]
    url: str = ""


def mesh_up(name: str, home: Path, model: str, routing: str, *extra: str) -> Member:
    home.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-c", "from mesh.cli import main; main()", "up", "--home", str(home)]
    argv += ["--model", model, "--port", "0", "--mesh-host", "127.0.0.1", "--mesh-port", "0"]
    argv += ["--no-discovery", "--routing", routing, *extra]
    log = (home / "node.log").open("wb")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    return Member(name, home, process)


async def ready(member: Member, limit_s: float = 300) -> None:
    node_file = member.home / "node.json"
    deadline = time.monotonic() + limit_s
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() < deadline:
            if member.process.poll() is not None:
                raise RuntimeError((member.home / "node.log").read_text()[-3000:])
            if node_file.exists():
                member.url = orjson.loads(node_file.read_bytes())["url"]
                try:
                    if (await http.get(f"{member.url}/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{member.name} not ready")


def invite(home: Path) -> str:
    argv = [
        sys.executable,
        "-c",
        "from mesh.cli import main; main()",
        "invite",
        "--home",
        str(home),
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    return result.stdout.strip().splitlines()[-1]


async def peers_see_model(members: list[Member], model: str) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        for _ in range(240):
            counts = []
            for member in members:
                status = (await http.get(f"{member.url}/api/status")).json()
                counts.append(sum(any(ad["name"] == model for ad in p.get("models", [])) for p in status.get("peers", [])))  # fmt: skip
            if all(c >= len(members) - 1 for c in counts):
                return
            await asyncio.sleep(0.5)
    raise RuntimeError("members never saw each other's model")


@dataclass
class Turn:
    prompt_tokens: int
    cached_tokens: int
    reason: str
    peer: str
    completion_tokens: int
    text: str
    seconds: float


async def chat(http: httpx.AsyncClient, member: Member, model: str, messages: list[dict]) -> Turn:
    body = {"model": model, "messages": messages, "max_tokens": 48}
    started = time.monotonic()
    response = await http.post(f"{member.url}/v1/chat/completions", json=body)
    response.raise_for_status()
    data = response.json()
    usage = data["usage"]
    return Turn(
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        reason=response.headers.get("x-mesh-route-reason", ""),
        peer=response.headers.get("x-peer", ""),
        completion_tokens=usage["completion_tokens"],
        text=data["choices"][0]["message"]["content"],
        seconds=time.monotonic() - started,
    )


async def one_conversation(
    http: httpx.AsyncClient, members: list[Member], model: str, index: int, opening: str
) -> dict:
    first, second = members[index % 2], members[(index + 1) % 2]
    turn1_messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": opening}]
    turn1 = await chat(http, first, model, turn1_messages)
    follow_up = f"{FOLLOW_UPS[index % len(FOLLOW_UPS)]} (conversation {index})"
    turn2_messages = [*turn1_messages, {"role": "assistant", "content": turn1.text}]
    turn2_messages.append({"role": "user", "content": follow_up})
    turn2 = await chat(http, second, model, turn2_messages)
    return {
        "conversation": index,
        "shared_opening": opening in SHARED_OPENINGS,
        "turn1": turn1.__dict__,
        "turn2": turn2.__dict__,
        "entered": [first.name, second.name],
        # At most turn 1's prompt and answer: the follow-up and its template tokens are new.
        "share": turn2.cached_tokens / turn2.prompt_tokens,
        "ceiling": min(1.0, (turn1.prompt_tokens + turn1.completion_tokens) / turn2.prompt_tokens),
    }


async def run(args: argparse.Namespace, tmp: Path) -> list[dict]:
    model = args.model or str(Path.home() / ".mlx-mesh" / "models" / "smollm2-135m")
    extra = ["--prompt-cache-disk-gb", "0"]
    a = mesh_up("A", tmp / "a", model, args.routing, *extra)
    members = [a]
    try:
        await ready(a)
        b = mesh_up("B", tmp / "b", model, args.routing, "--join", invite(a.home), *extra)
        members.append(b)
        await ready(b)
        name = Path(model).name if "/" in model else model
        await peers_see_model(members, name)
        rows = []
        async with httpx.AsyncClient(timeout=300) as http:
            openings = conversations(args.conversations)
            # Conversations run two at a time: each member has one turn to serve, as when two
            # people use the mesh at once; a conversation's turns follow each other at once.
            for start in range(0, len(openings), args.parallel):
                batch = range(start, min(start + args.parallel, len(openings)))
                rows += await asyncio.gather(
                    *(one_conversation(http, members, name, i, openings[i]) for i in batch)
                )
                for row in rows[-len(batch) :]:
                    print(
                        f"{row['conversation']:2d} share {row['share']:.2f} (ceiling"
                        f" {row['ceiling']:.2f}) turn2 {row['turn2']['reason']!r}"
                        f" peer={row['turn2']['peer']!r} {row['turn2']['seconds']:.1f}s",
                        flush=True,
                    )
        return rows
    finally:
        for member in members:
            member.process.send_signal(signal.SIGTERM)
        for member in members:
            try:
                member.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                member.process.kill()


def report(rows: list[dict], args: argparse.Namespace, model: str) -> str:
    shares = [r["share"] for r in rows]
    shared = [r["share"] for r in rows if r["shared_opening"]]
    lines = [
        "# Prompt cache routing: turn 2 at the other member",
        "",
        f"`python bench/prompt_cache_routing.py --conversations {args.conversations}"
        f" --routing {args.routing}` on {platform.machine()} {platform.system()}, model"
        f" `{Path(model).name}`: two `mesh up` members on loopback, no session header, turn 1"
        " at one member and turn 2 at the other the moment turn 1 answered"
        f" ({args.parallel} conversations at a time). Share: turn 2's cached prompt tokens over"
        " its prompt tokens, as the serving worker reported them. Ceiling: turn 1's prompt and"
        " answer over turn 2's prompt.",
        "",
        f"- every turn 2 ≥ 0.9: **{'yes' if min(shares) >= 0.9 else 'no'}**"
        f" (min {min(shares):.3f}, median {statistics.median(shares):.3f},"
        f" mean {statistics.mean(shares):.3f}; {sum(s >= 0.9 for s in shares)}/{len(shares)})",
        f"- conversations that open alike ({len(shared)}): min {min(shared, default=0):.3f}",
        "",
        "| # | opens alike | turn 1 entered | turn 2 entered | turn 2 prompt | cached | share |"
        " ceiling | turn 2 route reason | turn 2 s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t2 = r["turn2"]
        lines.append(
            f"| {r['conversation']} | {'yes' if r['shared_opening'] else ''} | {r['entered'][0]}"
            f" | {r['entered'][1]} | {t2['prompt_tokens']} | {t2['cached_tokens']}"
            f" | {r['share']:.3f} | {r['ceiling']:.3f} | `{t2['reason']}` | {t2['seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--routing", default="cache")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        rows = await run(args, Path(name))
    model = args.model or "smollm2-135m"
    text = report(rows, args, model)
    print(text)
    if not args.no_write:
        args.out.write_text(text)
        args.out.with_suffix(".jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
