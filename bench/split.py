"""Split serving on one box: the same model whole vs split over 2 (and 3) rank processes.

Baseline: the model unsplit in one process (``python -m worker.split_rank --single``, the same
lockstep loop with no group). Candidates: split over 2 ranks on the ring backend, directly on
loopback and through the TLS bridge (mesh/split/bridge.py, both "nodes" on this box), and over
3 ranks directly. Per configuration, the same prompts (random token ids) are answered greedily:
TTFT (prefill of ``--prompt-tokens``) and decode ms per token (median over ``--runs`` prompts
after one warm-up prompt), plus each rank's memory (bytes of its layers' weights, MLX active
memory after the run, peak RSS). The bridge's cost per token is bridged minus direct decode.

Writes bench/results/split.md.

    python bench/split.py [--model DIR] [--prompt-tokens 256] [--max-tokens 64] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mesh.copy.tls import cert_der  # noqa: E402
from mesh.identity import NodeIdentity  # noqa: E402
from mesh.split.bridge import BridgeLink, BridgeServer  # noqa: E402
from worker.layout import read_layout  # noqa: E402

DEFAULT_MODEL = Path.home() / ".mlx-mesh" / "models" / "smollm2-135m"


def free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def even_split(layers: int, ranks: int) -> list[int]:
    base, extra = divmod(layers, ranks)
    return [base + (1 if r < extra else 0) for r in range(ranks)]


def run(
    model: Path,
    args: argparse.Namespace,
    prompts: Path,
    split: list[int] | None,
    hostfiles: dict[int, list] | None = None,
) -> list[dict[str, Any]]:
    command = [
        sys.executable, "-m", "worker.split_rank", "--model", str(model),
        "--prompts", str(prompts), "--max-tokens", str(args.max_tokens),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if split is None:
        procs = [subprocess.Popen([*command, "--single"], env=env, stdout=subprocess.PIPE)]
    else:
        if hostfiles is None:
            shared = [[f"127.0.0.1:{p}"] for p in free_ports(len(split))]
            hostfiles = dict.fromkeys(range(len(split)), shared)
        procs = []
        for rank in range(len(split)):
            hostfile = prompts.parent / f"hosts-{rank}.json"
            hostfile.write_text(json.dumps(hostfiles[rank]))
            rank_env = {**env, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
            split_arg = ",".join(map(str, split))
            procs.append(
                subprocess.Popen(
                    [*command, "--split", split_arg], env=rank_env, stdout=subprocess.PIPE
                )
            )
    lines = []
    for proc in procs:
        out, _ = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"a rank failed ({proc.returncode})")
        lines += [json.loads(x) for x in out.decode().splitlines() if x.startswith("{")]
    return lines


class Bridges:
    """Two identities ("nodes"), a bridge server each, a link each way: rank 0 on a, 1 on b."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.parts: list[Any] = []

    def hostfiles(self) -> dict[int, list]:
        own = free_ports(2)

        async def start() -> tuple[int, int]:
            a, b = NodeIdentity.generate(), NodeIdentity.generate()
            server_a = BridgeServer(a, trusted=lambda: [cert_der(b)])
            server_b = BridgeServer(b, trusted=lambda: [cert_der(a)])
            port_a, port_b = await server_a.start("127.0.0.1"), await server_b.start("127.0.0.1")
            server_a.register("g", 0, own[0])
            server_b.register("g", 1, own[1])
            to_b = BridgeLink(a, ("127.0.0.1", port_b), cert_der(b), b.node_id, "g", 1)
            to_a = BridgeLink(b, ("127.0.0.1", port_a), cert_der(a), a.node_id, "g", 0)
            self.parts = [server_a, server_b, to_b, to_a]
            return await to_b.start(), await to_a.start()

        link_b, link_a = asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)
        return {
            0: [[f"127.0.0.1:{own[0]}"], [f"127.0.0.1:{link_b}"]],
            1: [[f"127.0.0.1:{link_a}"], [f"127.0.0.1:{own[1]}"]],
        }

    def close(self) -> None:
        async def stop() -> None:
            for part in self.parts:
                await part.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def summarize(name: str, lines: list[dict[str, Any]]) -> dict[str, Any]:
    answers = [x for x in lines if "tokens" in x][1:]  # the first prompt warms up
    ranks = sorted((x for x in lines if "rank" in x), key=lambda x: x["rank"])
    return {
        "name": name,
        "ttft_ms": statistics.median(a["ttft_s"] for a in answers) * 1000,
        "decode_ms": statistics.median(
            a["decode_s"] / max(1, len(a["tokens"]) - 1) for a in answers
        )
        * 1000,
        "tokens": [a["tokens"] for a in answers],
        "ranks": ranks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "split.md")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"no model at {args.model} (mesh models pull smollm2-135m, or --model)")
    layout = read_layout(args.model)
    config = json.loads((args.model / "config.json").read_text())
    rng = random.Random(0)
    vocab = int(config.get("vocab_size") or 1000)
    prompts = [
        [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.runs + 1)
    ]
    work = ROOT / "bench" / ".split-work"
    work.mkdir(exist_ok=True)
    prompt_file = work / "prompts.json"
    prompt_file.write_text(json.dumps(prompts))

    n = layout.num_layers
    results = [summarize("unsplit (1 process)", run(args.model, args, prompt_file, None))]
    print(results[-1]["name"], f"{results[-1]['decode_ms']:.2f} ms/token", flush=True)
    results.append(
        summarize(
            "split 2 ranks, ring on loopback", run(args.model, args, prompt_file, even_split(n, 2))
        )
    )
    print(results[-1]["name"], f"{results[-1]['decode_ms']:.2f} ms/token", flush=True)
    bridges = Bridges()
    try:
        results.append(
            summarize(
                "split 2 ranks, through the TLS bridge",
                run(args.model, args, prompt_file, even_split(n, 2), bridges.hostfiles()),
            )
        )
    finally:
        bridges.close()
    print(results[-1]["name"], f"{results[-1]['decode_ms']:.2f} ms/token", flush=True)
    results.append(
        summarize(
            "split 3 ranks, ring on loopback", run(args.model, args, prompt_file, even_split(n, 3))
        )
    )
    print(results[-1]["name"], f"{results[-1]['decode_ms']:.2f} ms/token", flush=True)
    write_report(args, layout, results)


def write_report(args: argparse.Namespace, layout: Any, results: list[dict[str, Any]]) -> None:
    base = results[0]
    mb = 1e6
    lines = [
        "# Split serving on one box",
        "",
        f"`python bench/split.py` on {platform.platform()} ({os.cpu_count()} CPUs), model "
        f"`{args.model.name}` ({layout.num_layers} layers, "
        f"{sum(layout.layer_bytes) / mb:.0f} MB of layers + {layout.shared_bytes / mb:.0f} MB "
        f"shared), {args.prompt_tokens}-token prompts, {args.max_tokens} tokens greedy, median "
        f"of {args.runs} prompts after a warm-up. Every configuration runs the same lockstep "
        "loop (worker/split_rank.py); the baseline is the unsplit model in one process.",
        "",
        "| configuration | TTFT ms | vs unsplit | decode ms/token | vs unsplit | same tokens |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        same = "yes" if r["tokens"] == base["tokens"] else "NO"
        lines.append(
            f"| {r['name']} | {r['ttft_ms']:.0f} | {r['ttft_ms'] / base['ttft_ms']:.2f}x | "
            f"{r['decode_ms']:.2f} | {r['decode_ms'] / base['decode_ms']:.2f}x | {same} |"
        )
    direct, bridged = results[1], results[2]
    lines += [
        "",
        f"**Bridge cost per token**: {bridged['decode_ms'] - direct['decode_ms']:+.2f} ms "
        f"(decode through the TLS bridge minus the direct ring, 2 ranks); TTFT "
        f"{bridged['ttft_ms'] - direct['ttft_ms']:+.0f} ms.",
        "",
        "## Memory per rank",
        "",
        "| configuration | rank | layers | layer weights MB | MLX active MB | peak RSS MB |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in results:
        for rank in r["ranks"]:
            where = rank["slice"] or [0, layout.num_layers]
            lines.append(
                f"| {r['name']} | {rank['rank']} | {where[0]}-{where[1] - 1} | "
                f"{rank['layer_bytes'] / mb:.0f} | {rank['active_bytes'] / mb:.0f} | "
                f"{rank['peak_rss_bytes'] / mb:.0f} |"
            )
    lines += ["", *EXPLANATION]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


EXPLANATION = [
    "## What this says, and what a LAN of Macs should expect",
    "",
    "- On one box a split is never faster: the ranks share the same cores and memory "
    "bandwidth, and a decode step adds the lockstep command (two small `all_sum`s) and one "
    "activation hop per rank boundary to the same arithmetic. Pipeline parallelism does not "
    "speed up one stream at all: the stages run one after another. What it buys is room: "
    "each rank holds only its layers (the memory table), so a model that no single machine "
    "can hold runs at all.",
    "- Per token, a split over n machines adds about n-1 activation hops (hidden size x 4 "
    "bytes: 2.3 kB for SmolLM2, 16 kB for a 4096-wide model) plus the command broadcast, "
    "i.e. a few network latencies: ~0.2-0.5 ms per hop on wired gigabit Ethernet or "
    "Thunderbolt networking, 2-5 ms on Wi-Fi. Against a large model's 30-100 ms of compute "
    "per token on a Mac that is a few percent wired and 10-30 % on Wi-Fi; the bridge's own "
    "cost (TLS and one relay each side) is the difference measured above.",
    "- Prefill (TTFT) pays each hop once per chunk, not per token, so it is bound by the "
    "slowest stage's compute; an uneven plan (by offered memory) keeps the big machines "
    "busy with more layers.",
    "- Tensor parallelism (mlx-lm `shard()`) would split every layer instead and make one "
    "stream faster, but needs two all-reduces per layer: only worth it over Thunderbolt/RDMA "
    "(JACCL), not Ethernet or Wi-Fi.",
]


if __name__ == "__main__":
    main()
