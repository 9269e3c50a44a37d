"""Benchmark: the first request after a worker starts vs the second (issue 14, "no cold start").

Starts ``python -m worker`` as a child process, waits for its ``worker listening on`` line (what
the node waits for), then streams two chat requests one after the other (different questions,
greedy, the same token limit) and reports each one's time to first token and total time. With
``--compare`` it also starts a worker with ``--no-warm-up`` in the same run: the baseline. Every
case runs twice: with a fresh ``$TMPDIR``, so MLX's CPU kernel cache starts empty as on a freshly
booted machine, and with the machine's own (warm after the first: a restart).

Models: each ``--model`` (a directory or store name), else the tiny random-weight test model
plus ``smollm2-135m`` when it is in the home. Writes ``bench/results/warmup.md``.

    python bench/warmup.py [--model DIR ...] [--tokens 16] [--compare] [--kernel-cache fresh]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

# Like for like with mlx-lm (and random-weight models that loop under greedy decoding):
# every answer runs to max_tokens, no loop guard (worker/engine/loop_guard.py).
os.environ.setdefault("MLX_MESH_LOOP_GUARD", "0")

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "warmup.md"
QUESTIONS = ("What is the capital of France?", "Name three rivers in Europe.")


@dataclass
class Timing:
    ttft_s: float
    total_s: float
    tokens: int


@dataclass
class Run:
    model: str
    kernels: str  # "empty" | "warm"
    warm_up: bool
    ready_s: float  # spawn -> "worker listening on"
    warm_up_s: float | None  # what the worker says its warm-up took
    first: Timing
    second: Timing


def stream_once(url: str, question: str, tokens: int) -> Timing:
    from gateway.testing import chat_stream_chunks

    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft = None
    completion = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for chunk in chat_stream_chunks(response.iter_lines()):
            if ttft is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - started
            if chunk.get("usage"):
                completion = chunk["usage"]["completion_tokens"]
    total = time.perf_counter() - started
    return Timing(ttft if ttft is not None else total, total, completion)


def measure(model: str, *, warm_up: bool, tokens: int, kernels: Path | None) -> Run:
    """One worker start; ``kernels``: a fresh TMPDIR, so MLX's CPU kernel cache
    (``$TMPDIR/mlx/``) starts empty as on a freshly booted machine (None: the shared one)."""
    command = [sys.executable, "-m", "worker", "--model", model, "--port", "0"]
    if not warm_up:
        command.append("--no-warm-up")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    if kernels is not None:
        kernels.mkdir(parents=True)
        env["TMPDIR"] = str(kernels)
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        assert process.stdout is not None
        for raw in process.stdout:
            line = raw.decode(errors="replace")
            if line.startswith("worker listening on "):
                break
        else:
            raise RuntimeError(f"worker for {model} exited ({process.wait()})")
        ready = time.perf_counter() - started
        url = line.split()[3]
        warm_up_s = None
        for raw in process.stdout:  # what it prints after the announcement, up to its last line
            said = raw.decode(errors="replace")
            if said.startswith("warm-up: "):
                warm_up_s = float(said.split()[-1].removesuffix("s"))
            if said.startswith("sampling defaults"):
                break
        first = stream_once(url, QUESTIONS[0], tokens)
        second = stream_once(url, QUESTIONS[1], tokens)
        cache = "empty" if kernels is not None else "warm"
        return Run(model, cache, warm_up, ready, warm_up_s, first, second)
    finally:
        process.terminate()
        process.wait(timeout=60)


def default_models(scratch: Path) -> list[str]:
    from worker.testing import make_tiny_model

    models = [str(make_tiny_model(scratch / "tiny"))]
    stored = Path(os.environ.get("MLX_MESH_HOME", Path.home() / ".mlx-mesh")) / "models"
    if (stored / "smollm2-135m").is_dir():
        models.append(str(stored / "smollm2-135m"))
    return models


def report(runs: list[Run], tokens: int) -> str:
    lines = [
        "# Warm-up: first vs second request after a worker starts",
        "",
        "Written by `bench/warmup.py` (one run, no trials: the first request happens once).",
        "",
        "Read with care: a shared 2-core machine where others run tests, so single-run ratios",
        "within about +-20% are noise. The two questions get answers of different lengths:",
        "compare the TTFT columns, not the totals.",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
        f"- machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        f"- settings: greedy, at most {tokens} tokens, streamed; the two questions differ, so the "
        "second request gets no prompt-cache help beyond the chat template's shared opening",
        "- MLX kernel cache: `empty` = a fresh $TMPDIR (a freshly booted machine), `warm` = the "
        "machine's own, already filled (a restart)",
        "- ready: from spawning `python -m worker` to its `worker listening on` line; warm-up: "
        "what the worker says that part took",
        "- warm-up `off`: the same worker with `--no-warm-up`, in the same run (the baseline)",
        "",
        "| model | kernel cache | warm-up (s) | ready (s) | 1st TTFT (s) | 2nd TTFT (s) | 1st/2nd TTFT "
        "| 1st total (s), tokens | 2nd total (s), tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        ratio = r.first.ttft_s / max(r.second.ttft_s, 1e-9)
        lines.append(
            f"| {Path(r.model).name} | {r.kernels} | {_warm(r)} | {r.ready_s:.2f} "
            f"| {r.first.ttft_s:.3f} | {r.second.ttft_s:.3f} | {ratio:.2f}x "
            f"| {r.first.total_s:.2f}, {r.first.tokens} | {r.second.total_s:.2f}, {r.second.tokens} |"
        )
    return "\n".join(lines) + "\n"


def _warm(run: Run) -> str:
    if not run.warm_up:
        return "off"
    return f"{run.warm_up_s:.2f}" if run.warm_up_s is not None else "on"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", action="append", default=None)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--compare", action="store_true", help="also run with --no-warm-up")
    parser.add_argument("--kernel-cache", choices=["fresh", "shared", "both"], default="both")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        models = args.model or default_models(Path(scratch))
        runs = []
        caches = {"fresh": [True], "shared": [False], "both": [True, False]}[args.kernel_cache]
        for model in models:
            for fresh in caches:
                for warm in [False, True] if args.compare else [True]:
                    kernels = Path(scratch) / f"tmp{len(runs)}" if fresh else None
                    run = measure(model, warm_up=warm, tokens=args.tokens, kernels=kernels)
                    print(run, flush=True)
                    runs.append(run)
    text = report(runs, args.tokens)
    print(text)
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
