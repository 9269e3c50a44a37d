"""A model split across real ``mesh up`` nodes, end to end through the gateway.

Baseline: one node serving the model whole (``mesh up --model M``), asked through its gateway.
Candidates, on the same box: the model split over two nodes (A serves it, ``--split-over B``;
B offers memory and copies the files its layers need from A with peer copy), asked through A's
gateway, and through B's (a forwarded route: B's gateway → tunnel → A's rank 0 → ring → B's
rank); and over three nodes (A, B, C). Every request is the same chat at temperature 0,
streamed: TTFT (to the first content token) and decode ms per token (median over ``--runs``
after a warm-up), and whether the answer is the same text as the whole model's.

This is the whole path a user gets – HTTP, gateway, worker engine, lockstep, ring over the
TLS bridge, tunnel for the forwarded route – where bench/split.py isolates the ring itself.

Writes bench/results/split-mesh.md.

    python bench/split_mesh.py [--model DIR] [--runs 3] [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from mesh_processes import Running, run_mesh, wait_for  # noqa: E402

from worker.store import model_path  # noqa: E402

DEFAULT_MODEL = Path.home() / ".mlx-mesh" / "models" / "smollm2-135m"
PROMPT = (
    "You are a careful assistant. Explain in plain words why the sky looks blue during the day "
    "and red at sunset, and what that has to do with the size of air molecules."
)


def ask(url: str, model: str, max_tokens: int) -> dict[str, Any]:
    """One streamed chat: its text, TTFT and decode time per token (after the first)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = last = None
    text, tokens = [], 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = orjson.loads(line[6:])
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(piece)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    assert first is not None and last is not None, "no content streamed"
    return {
        "text": "".join(text),
        "ttft_ms": (first - started) * 1000,
        "decode_ms": (last - first) * 1000 / max(1, tokens - 1),
    }


def measure(name: str, url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    ask(url, model, args.max_tokens)  # warm-up: kernels, caches, the route
    runs = [ask(url, model, args.max_tokens) for _ in range(args.runs)]
    print(f"  {name}: {statistics.median(r['decode_ms'] for r in runs):.1f} ms/token", flush=True)
    return {
        "name": name,
        "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
        "decode_ms": statistics.median(r["decode_ms"] for r in runs),
        "texts": [r["text"] for r in runs],
    }


def invite(home: Path) -> str:
    return run_mesh("invite", "--home", str(home), "--ttl", "10m").stdout.strip().splitlines()[-1]


def node_id(home: Path) -> str:
    return run_mesh("id", "--home", str(home)).stdout.strip().splitlines()[-1]


def served(url: str, model: str) -> bool:
    response = httpx.get(url + "/v1/models", timeout=10)
    return any(m["id"] == model for m in response.json()["data"])


def run_all(args: argparse.Namespace, work: Path) -> tuple[list[dict[str, Any]], float]:
    name = args.model.name
    shutil.copytree(args.model, model_path(work / "a", name))
    results = []
    whole = Running(work / "whole", "--model", str(args.model))
    try:
        results.append(measure("whole, one node", whole.url, name, args))
    finally:
        whole.stop()
    b = Running(work / "b", "--no-worker", "--share-memory", "4")
    nodes = [b]
    try:
        copy_started = time.perf_counter()
        a = Running(work / "a", "--model", name, "--join", invite(b.home), "--split-over",
                    node_id(b.home)[:12])  # fmt: skip
        nodes.append(a)
        wait_for(lambda: served(a.url, name), 600, "the split model")
        formed_s = time.perf_counter() - copy_started
        results.append(measure("split over 2 nodes, asked on A (rank 0)", a.url, name, args))
        wait_for(lambda: served(b.url, name), 60, "the route through B")
        results.append(measure("split over 2 nodes, asked on B (forwarded)", b.url, name, args))
        a.stop()
        nodes.remove(a)
        c = Running(work / "c", "--no-worker", "--share-memory", "4", "--join", invite(b.home))
        nodes.append(c)
        over = f"{node_id(b.home)[:12]},{node_id(c.home)[:12]}"
        a = Running(work / "a", "--model", name, "--split-over", over)
        nodes.append(a)
        wait_for(lambda: served(a.url, name), 600, "the model split three ways")
        results.append(measure("split over 3 nodes, asked on A (rank 0)", a.url, name, args))
    finally:
        for node in reversed(nodes):
            node.stop()
    return results, formed_s


def write_report(args: argparse.Namespace, results: list[dict[str, Any]], formed_s: float) -> None:
    base = results[0]
    lines = [
        "# A model split across real nodes, through the gateway",
        "",
        f"`python bench/split_mesh.py --model {args.model.name} --runs {args.runs} --max-tokens "
        f"{args.max_tokens}` on {platform.platform()} ({os.cpu_count()} CPUs, every node and "
        "rank on this one box: read the ratios, not the absolute times). Each node is a real "
        "`mesh up` process on loopback; the split's ranks talk through the TLS ring bridge; "
        "the same streamed chat at temperature 0 each time, medians after a warm-up.",
        "",
        "| configuration | TTFT ms | vs whole | decode ms/token | vs whole | same answer |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        same = "yes" if r["texts"] == base["texts"] else "NO"
        lines.append(
            f"| {r['name']} | {r['ttft_ms']:.0f} | {r['ttft_ms'] / base['ttft_ms']:.2f}x | "
            f"{r['decode_ms']:.1f} | {r['decode_ms'] / base['decode_ms']:.2f}x | {same} |"
        )
    lines += [
        "",
        f"- From `mesh up` on A to the model listed: {formed_s:.0f} s, including B copying the "
        "files its layers need from A (peer copy), both ranks loading their slices and the "
        "ring forming through the bridge.",
        "- The same prompt every time: after the warm-up each TTFT is a prompt-cache hit (all "
        "of the prompt but its last token reused), on every rank of a split as on the whole "
        "model – split rank 0 keeps the prompt cache, its other ranks mirror it.",
        "- Every rank shares this box's two cores, so a split is slower here; "
        "[split.md](split.md) isolates what the ring and the bridge add per token and says "
        "what a LAN of Macs should expect. The forwarded row adds the tunnel hop on top.",
        f"- Load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}.",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "split-mesh.md")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"no model at {args.model} (mesh models pull smollm2-135m, or --model)")
    with tempfile.TemporaryDirectory(prefix="split-mesh-") as tmp:
        results, formed_s = run_all(args, Path(tmp))
    write_report(args, results, formed_s)


if __name__ == "__main__":
    main()
