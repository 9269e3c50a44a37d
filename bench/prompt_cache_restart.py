"""Benchmark: an agent's next turn after its worker restarted, with the prompt cache's disk tier
against a cold prefill of the same prompt, measured in one run (issue 45's restart case).

One ``python -m worker`` on the model serves turn 1 of a conversation with a long system prompt
(an agent's instructions and files, ~``--prefix-tokens`` tokens), is stopped (SIGTERM, or SIGKILL
a few seconds after the turn: the cache must already be on disk), and started again on the same
home; turn 2 is then sent as a user sends it (the whole conversation). The baseline is the same
turn 2 sent to a worker started without a disk tier (``--prompt-cache-disk-gb 0``), which
prefills it all. Both at temperature 0: the answers must be the same text.

    python bench/prompt_cache_restart.py [--model DIR] [--prefix-tokens 3000] [--trials 2]

Writes ``bench/results/prompt-cache-disk.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_vs_mlx_lm import (
    ROOT,
    Server,
    long_prefix,
    pick_model,
    start,
    stream_chat,
    wait_ready,
)

from mesh.loopback_ports import free_port

RESULTS = ROOT / "bench" / "results" / "prompt-cache-disk.md"


def worker(label: str, model: str, home: Path, logs: Path, disk_gb: float | None) -> Server:
    port = free_port()
    command = [sys.executable, "-m", "worker", "--model", model, "--port", str(port)]
    command += ["--home", str(home), "--no-warm-up"]
    if disk_gb is not None:
        command += ["--prompt-cache-disk-gb", str(disk_gb)]
    return start(label, command, port, None, logs, env=dict(os.environ))


def stop(server: Server, how: signal.Signals) -> None:
    server.process.send_signal(how)
    server.process.wait(timeout=120)


async def one_trial(
    model: str, prefix: str, how: signal.Signals, tmp: Path, trial: int
) -> dict[str, float | bool]:
    home = tmp / f"home-{how.name}-{trial}"
    logs = tmp / "logs"
    logs.mkdir(exist_ok=True)
    system = f"[{trial}-{how.name}] {prefix}"
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Summarize it."}]
    async with httpx.AsyncClient(timeout=600) as http:
        first = worker("first", model, home, logs, None)
        await wait_ready(first, http)
        answer = await stream_chat(first, http, turn1, 16)
        # The commit lands after the answer; a long entry goes to disk as it is stored.
        await asyncio.sleep(3.0)
        stop(first, how)
        turn2 = [*turn1, {"role": "assistant", "content": answer.text}]
        turn2.append({"role": "user", "content": "Which part matters most?"})

        again = worker("restarted", model, home, logs, None)
        await wait_ready(again, http)
        warm = await stream_chat(again, http, turn2, 16)
        health = (await http.get(f"{again.base}/health")).json()
        stop(again, signal.SIGTERM)

        cold_server = worker("cold", model, tmp / f"cold-{how.name}-{trial}", logs, 0)
        await wait_ready(cold_server, http)
        cold = await stream_chat(cold_server, http, turn2, 16)
        stop(cold_server, signal.SIGTERM)
    return {
        "warm_ttft": warm.ttft_s,
        "cold_ttft": cold.ttft_s,
        "ratio": warm.ttft_s / cold.ttft_s,
        "same_text": warm.text == cold.text,
        "disk_loads": (health.get("prompt_cache_disk") or {}).get("loads", 0),
    }


def report(rows: dict[str, list[dict]], model: str, tokens: int, args: argparse.Namespace) -> str:
    lines = [
        "# Prompt cache disk tier: the next turn after a restart",
        "",
        f"`python bench/prompt_cache_restart.py --prefix-tokens {args.prefix_tokens}"
        f" --trials {args.trials}` on {platform.machine()} {platform.system()}, model"
        f" `{Path(model).name}`, a {tokens}-token system prompt. Turn 2's time to first token on"
        " the restarted worker (its cache read back from disk) against the same turn 2 on a"
        " worker without a disk tier (a cold prefill), same run; temperature 0.",
        "",
        "| stopped with | warm TTFT s | cold TTFT s | warm / cold | same text | loaded from disk | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for how, trials in rows.items():
        warm = statistics.median(t["warm_ttft"] for t in trials)
        cold = statistics.median(t["cold_ttft"] for t in trials)
        ratios = [t["ratio"] for t in trials]
        same = all(t["same_text"] for t in trials)
        lines.append(
            f"| {how} | {warm:.2f} | {cold:.2f} | {statistics.median(ratios):.3f}"
            f" ({min(ratios):.3f}-{max(ratios):.3f}) | {'yes' if same else 'NO'}"
            f" | {sum(t['disk_loads'] for t in trials)} of {len(trials)} | ≤ 0.3 |"
        )
    return "\n".join(lines) + "\n"


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prefix-tokens", type=int, default=3000)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        model, label = pick_model(args.model, tmp)
        prefix, tokens = long_prefix(model, args.prefix_tokens)
        print(f"model: {label}; prefix {tokens} tokens", flush=True)
        rows: dict[str, list[dict]] = {}
        for how in (signal.SIGTERM, signal.SIGKILL):
            for trial in range(args.trials):
                started = time.monotonic()
                result = await one_trial(model, prefix, how, tmp, trial)
                print(how.name, trial, result, f"{time.monotonic() - started:.0f}s", flush=True)
                rows.setdefault(how.name, []).append(result)
    text = report(rows, model, tokens, args)
    print(text)
    if not args.no_write:
        RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
