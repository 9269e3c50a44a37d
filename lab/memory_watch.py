"""Each node's memory over a run, sampled every second: the RSS of its process tree (``mesh up``
and every descendant: the workers), and the budget, weights and prompt-cache tiers its
``/health`` reports under ``workers.<model>`` (issue #45's memory bound).

The bound a node's RSS must stay under for the whole run is ``budget + weights + overhead``,
where the overhead is the node's own RSS at idle – measured after it is up and before the first
request, less the weights it already holds: the gateway's and the worker's interpreters, MLX,
the warm-up's leftovers – plus a stated ``margin`` for what the budget does not count
(a prefill's activations, allocator slack). Pure parts: :func:`parse_vm_rss`, :func:`bound_bytes`,
:func:`check_bound`, :func:`health_facts`, :func:`counters`.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from lab.procs import ManagedProcess

MB = 1 << 20


def parse_vm_rss(status: str) -> int | None:
    """Bytes of ``VmRSS`` in a ``/proc/PID/status`` text (None: no such line, e.g. a zombie)."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                unit = fields[2].lower() if len(fields) > 2 else "kb"
                return int(fields[1]) * {"kb": 1024, "mb": MB}.get(unit, 1)
    return None


def rss_bytes(pid: int) -> int:
    """One process's resident set: /proc on Linux, ``ps`` elsewhere; 0 when it is gone."""
    try:
        return parse_vm_rss(Path(f"/proc/{pid}/status").read_text()) or 0
    except FileNotFoundError:
        if Path("/proc/self").exists():
            return 0  # exited between listing and reading
    except OSError:
        return 0
    try:  # no /proc (macOS): ps reports KiB
        out = subprocess.run(
            ["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return 0
    return int(out) * 1024 if out.isdigit() else 0


def tree_rss(process: ManagedProcess) -> tuple[int, int, int]:
    """(bytes, processes, the root's bytes) over the process and its descendants: the root is
    ``mesh up`` (the gateway and the mesh), the others its workers. A page shared by two of
    them counts twice: the sum is an upper bound of what the node holds."""
    pids = process.tree()
    sizes = [rss_bytes(pid) for pid in pids]
    return sum(sizes), len(pids), sizes[0]


def health_facts(body: Mapping[str, Any]) -> dict[str, int]:
    """The figures of a node's ``/health`` the bound and the table need, summed over its
    workers: ``budget``, ``budget_used``, ``weights``, ``memory_tier``, ``disk_tier``,
    ``evictions``, ``disk_writes``, ``disk_loads`` (missing: left out)."""
    out: dict[str, int] = {}

    def add(name: str, block: Any, key: str) -> None:
        value = block.get(key) if isinstance(block, Mapping) else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = out.get(name, 0) + int(value)

    for worker in (body.get("workers") or {}).values():
        if not isinstance(worker, Mapping):
            continue
        memory, tier, disk = (
            worker.get(k) for k in ("memory", "prompt_cache", "prompt_cache_disk")
        )
        add("budget", memory, "limit_bytes")
        add("budget_used", memory, "used_bytes")
        add("weights", memory, "weight_bytes")
        add("memory_tier", tier, "bytes")
        add("evictions", tier, "evictions")
        add("disk_tier", disk, "bytes")
        add("disk_writes", disk, "writes")
        add("disk_loads", disk, "loads")
    return out


@dataclass
class Sample:
    t: float  # seconds since the watch started
    node: int
    start: int  # the node's start number (a restart is a fresh process tree)
    rss: int  # bytes over the tree
    processes: int
    root: int = 0  # bytes of the tree's root (mesh up: gateway and mesh); the rest: workers
    facts: dict[str, int] = field(default_factory=dict)  # health_facts (empty: no answer)


def counters(samples: Iterable[Sample], key: str) -> int:
    """A counter summed over each node's starts (it restarts from 0 with the process): the
    last value each (node, start) reported."""
    last: dict[tuple[int, int], int] = {}
    for s in samples:
        if key in s.facts:
            last[(s.node, s.start)] = s.facts[key]
    return sum(last.values())


def bound_bytes(budget: int, weights: int, overhead: int) -> int:
    return budget + weights + overhead


def overhead_bytes(idle_rss: int, weights: int, margin: int) -> int:
    """The node's idle RSS less the weights it holds (counted apart), plus the margin."""
    return max(0, idle_rss - weights) + margin


def check_bound(samples: Sequence[Sample], bounds: Mapping[int, int]) -> dict[int, dict]:
    """Per node with a bound: its largest RSS, the bound, how many samples went over."""
    out: dict[int, dict] = {}
    for node, bound in sorted(bounds.items()):
        rss = [s.rss for s in samples if s.node == node and s.rss]
        over = sum(1 for value in rss if value > bound)
        out[node] = {
            "max_rss": max(rss, default=0),
            "bound": bound,
            "samples": len(rss),
            "over": over,
            "ok": bool(rss) and not over,
        }
    return out


def busy_facts(facts: Mapping[str, int]) -> int:
    """Bytes and writes that only requests make (0 for a node that served nothing yet)."""
    return sum(facts.get(k, 0) for k in ("memory_tier", "disk_tier", "disk_writes", "budget_used"))


class MemoryWatch:
    """Samples every node of a lab run each ``interval_s``: ``await start()`` (after set-up:
    it records the idle baselines), ``await stop()`` at the end."""

    def __init__(self, nodes: Sequence[Any], *, interval_s: float = 1.0, margin: int = 0):
        self.nodes = nodes  # lab.nodes.LabNode: .index, .process, .starts, .url
        self.interval_s = interval_s
        self.margin = margin
        self.samples: list[Sample] = []
        self.idle: dict[int, Sample] = {}  # each node's baseline
        self.idle_samples: list[Sample] = []
        self._t0 = time.monotonic()
        self.t0_wall = time.time()  # for placing the lab's events (kill, restart) on the samples
        self.marks: list[dict] = []  # {"t", "event", "node"?} in the samples' time
        self._task: asyncio.Task | None = None
        self._client = httpx.AsyncClient(trust_env=False, timeout=2)

    async def sample(self) -> list[Sample]:
        taken = []
        for node in self.nodes:
            process = node.process
            if process is None or not process.running():
                continue
            rss, count, root = await asyncio.to_thread(tree_rss, process)
            facts: dict[str, int] = {}
            try:
                response = await self._client.get(f"{node.url}/health")
                if response.status_code == 200:
                    facts = health_facts(response.json())
            except (httpx.HTTPError, ValueError):
                pass  # a node that does not answer now still has its RSS sampled
            t = round(time.monotonic() - self._t0, 2)
            taken.append(Sample(t, node.index, node.starts, rss, count, root, facts))
        self.samples += taken
        return taken

    async def start(self, idle_samples: int = 3) -> None:
        """The idle baseline (the largest of a few samples a second apart), then the loop."""
        for _ in range(idle_samples):
            taken = await self.sample()
            self.idle_samples += taken
            for s in taken:
                if s.rss > self.idle.get(s.node, Sample(0, 0, 0, 0, 0)).rss:
                    self.idle[s.node] = s
            await asyncio.sleep(self.interval_s)
        self._task = asyncio.create_task(self._loop())

    @property
    def idle_clean(self) -> bool:
        """No prompt cached and nothing written during the idle samples: a baseline taken
        while requests already ran would raise the bound."""
        return all(busy_facts(s.facts) == 0 for s in self.idle_samples)

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            await self.sample()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self._client.aclose()

    def mark(self, event: str, wall: float | None = None, **details: object) -> None:
        """Note an event at ``wall`` (time.time(); None: now) in the samples' time."""
        at = time.time() if wall is None else wall
        self.marks.append({"t": round(at - self.t0_wall, 2), "event": event, **details})

    def bounds(self) -> dict[int, int]:
        """Each node's bound, from its idle baseline and the budget and weights it reported
        (none for a node without a budget)."""
        out = {}
        for node, idle in self.idle.items():
            facts = next((s.facts for s in self.samples if s.node == node and s.facts), {})
            if "budget" not in facts:
                continue
            weights = facts.get("weights", 0)
            overhead = overhead_bytes(idle.rss, weights, self.margin)
            out[node] = bound_bytes(facts["budget"], weights, overhead)
        return out

    def summary(self) -> dict:
        bounds = self.bounds()
        first = {n: next((s.facts for s in self.samples if s.node == n and s.facts), {}) for n in self.idle}  # fmt: skip
        return {
            "margin": self.margin,
            "idle_rss": {n: s.rss for n, s in self.idle.items()},
            "idle_clean": self.idle_clean,
            "budget": {n: f.get("budget") for n, f in first.items()},
            "weights": {n: f.get("weights") for n, f in first.items()},
            "max_rss": {
                n: max((s.rss for s in self.samples if s.node == n), default=0) for n in self.idle
            },
            # The last sample: what the node still holds once the load is over (a freed page the
            # allocator keeps shows here; a transient peak does not).
            "end_rss": {
                n: next((s.rss for s in reversed(self.samples) if s.node == n), 0)
                for n in self.idle
            },
            "idle_root": {n: s.root for n, s in self.idle.items()},
            "max_root": {
                n: max((s.root for s in self.samples if s.node == n), default=0) for n in self.idle
            },
            "bound": check_bound(self.samples, bounds),
            "evictions": counters(self.samples, "evictions"),
            "disk_writes": counters(self.samples, "disk_writes"),
            "disk_loads": counters(self.samples, "disk_loads"),
            "marks": sorted(self.marks, key=lambda m: m["t"]),
            "max_budget_used": max(
                (s.facts.get("budget_used", 0) for s in self.samples), default=0
            ),
        }

    def rows(self) -> list[dict]:
        return [asdict(s) for s in self.samples]


def _mb(value: int | None) -> str:
    return "–" if value is None else f"{value / MB:.0f}"


def render_memory(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The memory tables (markdown lines) of the runs that watched memory; [] when none did."""
    watched = {label: r for label, r in results.items() if "memory" in r}
    if not watched:
        return []
    lines = [
        "",
        "| run | requests | lost | 429s | cached/prompt | max RSS / bound MiB per node "
        "| bound met | max budget use MiB | spills (memory-tier evictions) | disk writes "
        "| disk loads |",
        "|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for label, r in watched.items():
        m = r["memory"]
        per_node = ", ".join(
            f"{n}: {_mb(rss)}" + (f" / {_mb(m['bound'][n]['bound'])}" if n in m["bound"] else "")
            for n, rss in sorted(m["max_rss"].items())
        )
        met = "–" if not m["bound"] else ("yes" if all(b["ok"] for b in m["bound"].values()) else "**no**")  # fmt: skip
        lines.append(
            f"| {label} | {r['requests']} | {r['lost']} | {r['refused_429']} "
            f"| {r['cached_ratio']:.3f} | {per_node} | {met} | {_mb(m['max_budget_used'] or None)} "
            f"| {m['evictions']} "
            f"| {m['disk_writes']} | {m['disk_loads']} |"
        )
    lines += [
        "",
        "| run | node | budget MiB | weights MiB | idle RSS MiB | overhead MiB | bound MiB "
        "| max RSS MiB | RSS at the end MiB | samples over bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for label, r in watched.items():
        m = r["memory"]
        for n in sorted(m["idle_rss"]):
            b = m["bound"].get(n)
            budget, weights = m["budget"].get(n), m["weights"].get(n)
            bound = None if b is None else b["bound"]
            overhead = None if bound is None else bound - (budget or 0) - (weights or 0)
            weighed = "–" if weights is None else f"{weights / MB:.2f}"
            over = "–" if b is None else f"{b['over']} of {b['samples']}"
            idle = _mb(m["idle_rss"][n]) + ("" if m.get("idle_clean", True) else " (not idle!)")
            lines.append(
                f"| {label} | {n} | {_mb(budget)} | {weighed} | {idle} "
                f"| {_mb(overhead)} | {_mb(bound)} | {_mb(m['max_rss'][n])} "
                f"| {_mb(m['end_rss'].get(n))} | {over} |"
            )
    return lines
