"""Routing compared on replayed agent sessions: one fresh mesh per routing mode, same sessions.

    python -m lab.routing_compare [SCENARIO] --out DIR [--markdown FILE]   (default: routing)

For each mode of the scenario's ``[sessions]`` (see :class:`lab.scenario.SessionsSpec`) it
starts the scenario's nodes with ``mesh up --routing MODE``, runs every session concurrently
(Anthropic Messages, streamed: what the captured agent sent), kills and restarts a node midway,
and reads each answer's usage (``input_tokens``, ``cache_read_input_tokens``), its time to
first token and its ``x-mesh-route-reason``. A request whose entry node dies under it is sent
once more at another node, as an agent harness retries; one that fails twice is lost. Then the
hedge runs: healthy (the hedge rate when nothing is slow) and with one node's worker slowed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console

from lab.memory_watch import MB, MemoryWatch, render_memory
from lab.netlab import LabOptions, NetLab
from lab.nodes import LabError, healthy, wait_until
from lab.scenario import NodeStep, Scenario, SessionsSpec, SlowStep, load_scenario

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "agent_conversation.json"


def build_sessions(count: int, fixture: dict) -> list[list[dict]]:
    """Each session's requests (Messages bodies without model/stream), turn by turn: the
    captured conversation up to each user turn, its first message under a task line of its
    own, so sessions share the system prompt and tools and nothing after."""
    sessions = []
    for i in range(count):
        messages = json.loads(json.dumps(fixture["messages"]))
        first = messages[0]
        first["content"] = f"Task {i} of the sprint (repo r{i}). " + first["content"]
        turns = []
        for k, message in enumerate(messages):
            follows = messages[k + 1]["role"] if k + 1 < len(messages) else "assistant"
            if message["role"] != "assistant" and follows == "assistant":
                body = {"system": fixture["system"], "tools": fixture["tools"]}
                turns.append(body | {"messages": messages[: k + 1]})
        sessions.append(turns)
    return sessions


@dataclass
class Turn:
    session: int
    turn: int
    entry: int
    ok: bool = False
    ttft_s: float | None = None
    input_tokens: int = 0
    cached_tokens: int = 0
    reason: str = ""
    hedge: str = ""
    attempts: int = 0
    error: str = ""
    refused: int = 0  # 429 answers (the budget's full queue), each followed by a retry


async def send(client: httpx.AsyncClient, url: str, body: dict, session: str | None, turn: Turn) -> None:  # fmt: skip
    headers = {"x-session-id": session} if session else {}
    started = time.monotonic()
    async with client.stream("POST", f"{url}/v1/messages", json=body, headers=headers) as response:
        turn.reason = response.headers.get("x-mesh-route-reason", "")
        turn.hedge = response.headers.get("x-mesh-hedge", "")
        if response.status_code == 429:
            turn.refused += 1
        if response.status_code != 200:
            turn.error = f"{response.status_code} {(await response.aread())[:200]!r}"
            return
        event = ""
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event:
                data = json.loads(line[5:])
                usage = data.get("usage") or data.get("message", {}).get("usage") or {}
                turn.input_tokens = usage.get("input_tokens", turn.input_tokens)
                turn.cached_tokens = usage.get("cache_read_input_tokens", turn.cached_tokens)
                if event == "content_block_delta" and turn.ttft_s is None:
                    turn.ttft_s = time.monotonic() - started
                if event == "message_stop":
                    turn.ok = True
                if event == "error":
                    turn.error = str(data)[:200]


@dataclass
class Driver:
    lab: NetLab
    spec: SessionsSpec
    model: str
    rng: random.Random
    turns: list[Turn] = field(default_factory=list)
    up: set[int] = field(default_factory=set)
    done: int = 0
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # set as each turn ends

    async def session(self, client: httpx.AsyncClient, index: int, bodies: list[dict]) -> None:
        key = f"agent-session-{index}" if self.spec.session_keys else None
        for number, body in enumerate(bodies):
            body = body | {"model": self.model, "stream": True, "max_tokens": self.spec.max_tokens}
            turn = Turn(index, number, entry=-1)
            while turn.attempts < 2 and not turn.ok:
                turn.entry = self.rng.choice(sorted(self.up))
                turn.attempts += 1
                turn.error = ""
                try:
                    await send(client, self.lab.nodes[turn.entry].url, body, key, turn)
                except (httpx.HTTPError, ValueError) as exc:
                    turn.error = f"{type(exc).__name__}: {exc}"[:200]
            self.turns.append(turn)
            self.done += 1
            self.progress.set()

    async def until_done(self, turns: float) -> None:
        while self.done < turns:
            self.progress.clear()
            await self.progress.wait()

    async def timeline(self, total: int, scenario: Scenario) -> None:
        """Kill the stop node at ``stop_at`` of the turns, restart it at ``restart_at``."""
        node = self.spec.stop_node
        if node is None:
            return
        await self.until_done(self.spec.stop_at * total)
        self.up.discard(node)
        await self.lab.timeline.apply(NodeStep(at=0, action="kill", node=node))
        await self.until_done(self.spec.restart_at * total)
        await self.lab.timeline.apply(NodeStep(at=0, action="restart", node=node))
        async with httpx.AsyncClient(trust_env=False) as client:
            back = self.lab.nodes[node]
            await wait_until(f"node {node} back", lambda: healthy(client, back), 240, back)
        self.lab.event("back", node=node)
        self.up.add(node)


async def one_run(scenario: Scenario, out: Path, run: Run, *, console: Console) -> dict:
    spec = scenario.sessions
    assert spec is not None
    kill, slow = run.kill, run.slow
    lab = NetLab(scenario, LabOptions(out_dir=out, up_args=run.up_args), console)
    started = time.monotonic()
    watch: MemoryWatch | None = None
    try:
        await lab.setup()
        if run.watch:  # after set-up: the first samples are each node's idle baseline
            watch = MemoryWatch(lab.nodes, margin=int(spec.rss_margin_mb * MB))
            await watch.start()
        model = lab.nodes[0].model_id
        driver = Driver(lab, spec, model, random.Random(spec.seed))
        driver.up = {n.index for n in lab.nodes if n.running()}
        driver.spec = spec.model_copy(update={"session_keys": run.session_keys})
        if not kill:
            driver.spec = driver.spec.model_copy(update={"stop_node": None})
        if slow:
            await lab.timeline.apply(
                SlowStep(
                    at=0, action="slow", node=spec.slow_node, duty=spec.slow_duty, period_ms=200
                )
            )
        sessions = build_sessions(spec.count, json.loads(FIXTURE.read_text()))
        total = sum(len(s) for s in sessions)
        limits = httpx.Timeout(120, connect=5)
        if watch is not None:
            watch.mark("sessions start")
        async with httpx.AsyncClient(trust_env=False, timeout=limits) as client:
            timeline = asyncio.create_task(driver.timeline(total, scenario))
            await asyncio.gather(*(driver.session(client, i, s) for i, s in enumerate(sessions)))
            timeline.cancel()
        if watch is not None:
            watch.mark("sessions end")
            await asyncio.sleep(4)  # the nodes' /health counters lag by a probe interval
            for event in lab.events:
                if event["event"] in ("kill", "start", "back") and event["t"] > watch.t0_wall:
                    watch.mark(event["event"], event["t"], node=event.get("node"))
    finally:
        if watch is not None:
            await watch.stop()
        await lab.close()
    rows = [t.__dict__ for t in driver.turns]
    (out / "turns.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = summarize(driver.turns) | {"wall_s": round(time.monotonic() - started, 1)}
    if watch is not None:
        path = out / "memory.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in watch.rows()))
        result["memory"] = watch.summary() | {"samples_file": str(path)}
    return result


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(turns: list[Turn]) -> dict:
    ok = [t for t in turns if t.ok]
    # Anthropic usage: input_tokens are the uncached ones; the prompt is both together.
    prompt = sum(t.input_tokens + t.cached_tokens for t in ok)
    cached = sum(t.cached_tokens for t in ok)
    ttfts = [t.ttft_s for t in ok if t.ttft_s is not None]
    reasons: dict[str, int] = {}
    for t in ok:
        word = t.reason.split(" ")[0] or "-"
        reasons[word] = reasons.get(word, 0) + 1
    return {
        "requests": len(turns),
        "ok": len(ok),
        "lost": len(turns) - len(ok),
        "client_retries": sum(t.attempts - 1 for t in turns),
        "refused_429": sum(t.refused for t in turns),
        "cached_ratio": cached / prompt if prompt else 0.0,
        "ceiling": ceiling(ok),
        "prompt_tokens": prompt,
        "prefill_tokens": prompt - cached,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p95_s": _pct(ttfts, 0.95),
        "hedged": sum(1 for t in ok if t.hedge),
        "reasons": reasons,
    }


def ceiling(ok: list[Turn]) -> float:
    """The cached/prompt a perfect router with unbounded caches would reach on these turns: a
    session's turn can find at most its previous turn's prompt cached (the replayed assistant
    turn that follows it is not what the model generated), its first turn the prefix all
    sessions share (the most any first turn found cached)."""
    shared = max((t.cached_tokens for t in ok if t.turn == 0), default=0)
    by_session: dict[int, list[Turn]] = {}
    for t in ok:
        by_session.setdefault(t.session, []).append(t)
    best = total = 0
    for turns in by_session.values():
        previous = shared
        for t in sorted(turns, key=lambda t: t.turn):
            prompt = t.input_tokens + t.cached_tokens
            best += min(previous, prompt)
            total += prompt
            previous = prompt
    return best / total if total else 0.0


@dataclass(frozen=True)
class Run:
    label: str
    up_args: list[str]  # mesh up flags
    kill: bool = True  # kill and restart the stop node midway
    slow: bool = False  # hold the slow node to its CPU duty
    session_keys: bool = True  # the clients send their session ids (as the scenario says)
    watch: bool = False  # sample every node's memory (lab/memory_watch.py)


def _gib(gb: float) -> str:
    """--memory-gb's GiB in words: "16 MiB" below one."""
    return f"{gb:g} GiB" if gb >= 1 else f"{gb * 1024:g} MiB"


def runs(spec: SessionsSpec) -> list[Run]:
    """Each routing with the scenario's session keys; then, where the scenario sends them,
    each without (``keyless``: clients that send no session id, whose turns only the cache
    can place); then the hedge runs."""
    sizes: list[str] = []  # the prompt cache's tiers
    for flag, gb in (
        ("--prompt-cache-gb", spec.prompt_cache_gb),
        ("--prompt-cache-disk-gb", spec.prompt_cache_disk_gb),
    ):
        sizes += [] if gb is None else [flag, f"{gb:g}"]
    watch = spec.memory_gb is not None
    cache = sizes + (["--memory-gb", f"{spec.memory_gb:g}"] if watch else [])
    budget = f", budget {_gib(spec.memory_gb)}" if spec.memory_gb is not None else ""
    keys = spec.session_keys
    out = [
        Run(f"{mode}{budget}", ["--routing", mode, *cache], session_keys=keys, watch=watch)
        for mode in spec.routings
    ]
    for mode in spec.unbounded:
        flags = ["--routing", mode, *sizes, "--memory-gb", "0"]
        out.append(Run(f"{mode}, no budget", flags, session_keys=keys, watch=watch))
    if spec.session_keys:
        for mode in spec.keyless:
            flags = ["--routing", mode, *cache]
            out.append(Run(f"{mode}, no session key", flags, session_keys=False))
    if spec.hedge_runs:
        mode, slowed = spec.routings[-1], f"node {spec.slow_node} slowed"
        for hedge, slow in (("auto", False), ("off", True), ("auto", True)):
            label = f"{mode}, hedge {hedge}, {slowed if slow else 'healthy'}"
            flags = ["--routing", mode, "--hedge", hedge, *cache]
            out.append(Run(label, flags, kill=False, slow=slow, session_keys=spec.session_keys))
    return out


def render(scenario: Scenario, results: dict[str, dict]) -> str:
    spec = scenario.sessions
    assert spec is not None
    lines = [
        f"# {scenario.name}: {scenario.description}",
        "",
        "| run | requests | lost | client retries | cached/prompt | ceiling | prefill tokens "
        "| TTFT p50 / p95 s | hedged | route reasons | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---|---:|",
    ]
    for label, r in results.items():
        p50 = "–" if r["ttft_p50_s"] is None else f"{r['ttft_p50_s']:.2f}"
        p95 = "–" if r["ttft_p95_s"] is None else f"{r['ttft_p95_s']:.2f}"
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items()))
        lines.append(
            f"| {label} | {r['requests']} | {r['lost']} | {r['client_retries']} "
            f"| {r['cached_ratio']:.3f} | {r['ceiling']:.3f} | {r['prefill_tokens']} "
            f"| {p50} / {p95} "
            f"| {r['hedged']} | {reasons} | {r['wall_s']} |"
        )
    lines += render_memory(results)
    return "\n".join(lines) + "\n"


async def compare(scenario: Scenario, out: Path, console: Console, only: list[str]) -> dict:
    assert scenario.sessions is not None
    results: dict[str, dict] = {}
    for number, run in enumerate(runs(scenario.sessions)):
        if only and run.label not in only:
            continue
        console.rule(run.label)
        results[run.label] = await one_run(scenario, out / f"run-{number}", run, console=console)
        console.print(results[run.label])
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", nargs="?", default="routing")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--markdown", type=Path, help="write the table here too")
    parser.add_argument("--only", action="append", default=[], help="run only this label")
    parser.add_argument("--plot", type=Path, help="the RSS plot here too (runs with a budget)")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    scenario = load_scenario(args.scenario)
    if scenario.sessions is None:
        console.print(f"{scenario.name} has no [sessions]: run it with python -m lab.netlab")
        return 2
    try:
        results = asyncio.run(compare(scenario, args.out, console, args.only))
    except LabError as exc:
        console.print(f"[bold red]lab error:[/] {exc}")
        return 2
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    table = render(scenario, results)
    if any("memory" in r for r in results.values()):
        from lab.plots import rss_plot  # matplotlib only where there is something to draw

        for path in [args.out / "rss.png", *([args.plot] if args.plot else [])]:
            rss_plot(path, results)
    print(table)
    if args.markdown:
        args.markdown.write_text(table)
    return 0 if all(r["lost"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
