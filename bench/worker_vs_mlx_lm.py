"""Benchmark: our worker vs ``mlx_lm.server`` on the same model, measured in one run.

Both servers run as child processes on loopback; measurements alternate between them so machine
load drifts hit both alike. Metrics (greedy decoding, streamed):

- single stream: time to first token (TTFT) and decode tokens/s;
- four concurrent streams: aggregate tokens/s, and their mean TTFT;
- second turn after a ~1,000-token shared prefix: TTFT (prompt-cache reuse).

Model: ``--model`` if given, else the default model in the home (``models/smollm2-135m``), else a
tiny random-weight model (said so in the output). Writes ``bench/results/worker.md``.

The anchors: ``mlx_lm.server`` as a user starts it, and (on the CPU backend, where the worker
preloads OpenBLAS: worker/cpu/fast_path.py) ``mlx_lm.server`` given that same ``LD_PRELOAD``
(``worker.cpu.fast_path.preload_env()``), so the table shows what the engine adds given the same BLAS and
the same float32 weights. ``--anchors`` picks them (``preload,plain``).

    python bench/worker_vs_mlx_lm.py [--model DIR] [--tokens 32] [--trials 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

# Like for like with mlx-lm (and random-weight models that loop under greedy decoding):
# every answer runs to max_tokens, no loop guard (worker/engine/loop_guard.py).
os.environ.setdefault("MLX_MESH_LOOP_GUARD", "0")

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "worker.md"
FILLER = (
    "The committee reviewed the quarterly report on regional water supply, noting that "
    "reservoir levels, pipeline maintenance, and seasonal demand all shaped the outlook. "
)


@dataclass
class Server:
    label: str
    base: str
    model_field: str | None
    process: subprocess.Popen[bytes]
    log_path: Path


@dataclass
class StreamResult:
    ttft_s: float
    decode_tps: float
    tokens: int
    text: str


@dataclass
class Measurements:
    ttft: list[float] = field(default_factory=list)
    decode_tps: list[float] = field(default_factory=list)
    aggregate_tps: list[float] = field(default_factory=list)
    concurrent_ttft: list[float] = field(default_factory=list)  # mean of the four, per trial
    turn1_ttft: list[float] = field(default_factory=list)
    turn2_ttft: list[float] = field(default_factory=list)


def pick_model(arg: str | None, tmp: Path) -> tuple[str, str]:
    if arg:
        return arg, f"{arg} (--model)"
    home = Path(os.environ.get("MLX_MESH_HOME") or Path.home() / ".mlx-mesh")
    default = home / "models" / "smollm2-135m"
    if (default / "config.json").exists():
        return str(default), f"{default} (default model from the home)"
    sys.path.insert(0, str(ROOT))
    from worker.testing import make_tiny_model

    tiny = make_tiny_model(tmp / "tiny")
    return str(tiny), "TINY RANDOM-WEIGHT TEST MODEL (no default model in the home, no --model)"


def float32_copy(model_dir: str, tmp: Path) -> str:
    """The model with its weights stored as float32 (quantized ones unpacked), on the CPU.

    On the CPU backend our worker runs half-precision weights as float32 and unpacks quantized
    ones to float32 (worker/cpu/fast_path.py: x86 emulates fp16/bf16, ~30x slower per layer; MLX's CPU
    ``quantized_matmul`` runs at ~2 GFLOP/s). ``mlx_lm.server`` on the stored weights could not
    finish this benchmark, and would compare those casts rather than the servers: every server
    gets the same float32 copy instead (``mlx_lm.convert --dequantize --dtype float32``).
    """
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return model_dir
    source = Path(model_dir)
    config = orjson.loads((source / "config.json").read_bytes())
    quantized = "quantization" in config or "quantization_config" in config
    half = (mx.float16, mx.bfloat16)
    tensors = [mx.load(str(f)) for f in sorted(source.glob("*.safetensors"))]
    if not quantized and not any(a.dtype in half for t in tensors for a in t.values()):
        return model_dir
    from mlx_lm.convert import convert

    target = tmp / f"{source.name}-f32"
    convert(str(source), str(target), dequantize=quantized, dtype="float32")
    return str(target)


def start(
    label: str,
    command: list[str],
    port: int,
    model_field: str | None,
    logs: Path,
    env: dict[str, str] | None = None,
) -> Server:
    log_path = logs / f"{label.replace(' ', '_')}.log"
    log = log_path.open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    return Server(label, f"http://127.0.0.1:{port}", model_field, process, log_path)


async def wait_ready(server: Server, http: httpx.AsyncClient, limit_s: float = 180) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.label} exited:\n{server.log_path.read_text()[-2000:]}")
        try:
            if (await http.get(f"{server.base}/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{server.label} did not become ready")


async def stream_chat(
    server: Server, http: httpx.AsyncClient, messages: list[dict], max_tokens: int
) -> StreamResult:
    body: dict = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if server.model_field:
        body["model"] = server.model_field
    start = time.perf_counter()
    first = last = None
    chunks = 0
    usage_tokens = None
    text = []
    async with http.stream("POST", f"{server.base}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            frame = orjson.loads(line[6:])
            if frame.get("usage"):
                usage_tokens = frame["usage"]["completion_tokens"]
            for choice in frame.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
                    text.append(piece)
    done = time.perf_counter()
    if first is None or last is None:
        raise RuntimeError(f"{server.label} streamed no tokens")
    tokens = usage_tokens or chunks
    # Tokens over the whole request: robust to detokenizers that hold bytes back and then
    # release several tokens' text in one frame (the tiny model's junk does that).
    return StreamResult(first - start, tokens / (done - start), tokens, "".join(text))


def story_prompt() -> list[dict]:
    return [
        {"role": "user", "content": f"[{uuid.uuid4().hex[:8]}] Write a long story about a robot."}
    ]


async def single_stream(server: Server, http: httpx.AsyncClient, out: Measurements, n: int) -> None:
    result = await stream_chat(server, http, story_prompt(), n)
    out.ttft.append(result.ttft_s)
    out.decode_tps.append(result.decode_tps)


async def concurrent(server: Server, http: httpx.AsyncClient, out: Measurements, n: int) -> None:
    start = time.perf_counter()
    results = await asyncio.gather(
        *(stream_chat(server, http, story_prompt(), n) for _ in range(4))
    )
    out.aggregate_tps.append(sum(r.tokens for r in results) / (time.perf_counter() - start))
    out.concurrent_ttft.append(statistics.mean(r.ttft_s for r in results))


async def second_turn(
    server: Server, http: httpx.AsyncClient, out: Measurements, prefix: str
) -> None:
    messages = [
        {"role": "system", "content": f"[{uuid.uuid4().hex[:8]}] {prefix}"},
        {"role": "user", "content": "Summarize the report in one sentence."},
    ]
    first = await stream_chat(server, http, messages, 8)
    await asyncio.sleep(0.3)  # the client's think time between turns
    messages += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And in one word?"},
    ]
    second = await stream_chat(server, http, messages, 8)
    out.turn1_ttft.append(first.ttft_s)
    out.turn2_ttft.append(second.ttft_s)


def long_prefix(model_dir: str, target_tokens: int = 1000) -> tuple[str, int]:
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path)) if path.exists() else None
    text = ""
    while True:
        text += FILLER
        count = len(tokenizer.encode(text).ids) if tokenizer else len(text) // 4
        if count >= target_tokens:
            return text, count


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("mlx", "mlx-lm", "starlette", "uvicorn")}


def short_name(model_label: str) -> str:
    if model_label.startswith("TINY"):
        return "tiny test model"
    return Path(model_label.split(" ")[0]).name


ROWS = (  # (metric, Measurements field, better when)
    ("TTFT, one stream (s)", "ttft", "lower"),
    ("tok/s, one stream (tokens / request time)", "decode_tps", "higher"),
    ("aggregate tok/s, 4 concurrent streams", "aggregate_tps", "higher"),
    ("TTFT with 4 concurrent requests (s, mean of the four)", "concurrent_ttft", "lower"),
    ("TTFT, turn 1 with long prefix (s)", "turn1_ttft", "lower"),
    ("TTFT, turn 2 after shared prefix (s)", "turn2_ttft", "lower"),
)


def report(
    model_label: str,
    results: dict[str, Measurements],
    args: argparse.Namespace,
    prefix_tokens: int,
) -> str:
    ours = results["ours"]
    anchors = [label for label in results if label != "ours"]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        f"## Worker vs mlx_lm.server: {short_name(model_label)}",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
        f"- machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}; load average at the end {load}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()),
        f"- model: {model_label}",
        f"- settings: greedy, {args.tokens} tokens per stream, {args.trials} trials per metric "
        f"(medians), measurements alternate between the servers; long prefix {prefix_tokens} tokens",
        "",
        "| metric | ours | " + " | ".join(f"{a} | ours/{a}" for a in anchors) + " | better when |",
        "|---|---|" + "---|---|" * len(anchors) + "---|",
    ]
    missed = []
    for name, key, better in ROWS:
        a = median(getattr(ours, key))
        if a != a:  # NaN: metric not measured in this run (--metrics)
            continue
        cells = [f"{a:.3f}"]
        for anchor in anchors:
            b = median(getattr(results[anchor], key))
            ratio = a / b if b else float("nan")
            good = ratio <= 1.0 if better == "lower" else ratio >= 1.0
            if not good:
                missed.append(f"{name} vs {anchor} ({ratio:.2f})")
            cells += [f"{b:.3f}", f"{ratio:.2f}{'' if good else ' NO'}"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {better} |")
    verdict = "met" if not missed else "NOT met in this run: " + "; ".join(missed)
    lines += ["", f"Target no ratio worse than 1.0 against any anchor: **{verdict}**."]
    if ours.turn1_ttft:
        reuse = median(ours.turn2_ttft) / median(ours.turn1_ttft)
        reuse_verdict = "met" if reuse <= 0.3 else "NOT met"
        lines.append(
            f"Our second-turn TTFT is {reuse:.2f}x our first-turn TTFT "
            f"(target <= 0.3: **{reuse_verdict}**)."
        )
    lines += ["", "Raw samples (seconds or tokens/s):", "", "```"]
    width = max(len(label) for label in results)
    for label, m in results.items():
        for key, values in vars(m).items():
            if values:
                lines.append(f"{label:{width}} {key:15} {[round(v, 4) for v in values]}")
    lines += ["```", ""]
    return "\n".join(lines)


def anchor_commands(wanted: list[str]) -> list[tuple[str, dict[str, str] | None]]:
    """(label, environment) of each anchor: the preloaded one only where the worker preloads."""
    sys.path.insert(0, str(ROOT))
    from worker.cpu.fast_path import preload_env

    preloaded = preload_env()
    anchors: list[tuple[str, dict[str, str] | None]] = []
    for name in wanted:
        if name == "plain":
            anchors.append(("mlx_lm.server", None))
        elif name == "preload" and preloaded.get("LD_PRELOAD") != os.environ.get("LD_PRELOAD"):
            anchors.append(("mlx_lm.server+OpenBLAS", preloaded))
    return anchors


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per stream")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only, do not write results")
    parser.add_argument("--append", action="store_true", help="add a section to the results file")
    parser.add_argument(
        "--metrics",
        default="single,concurrent,second",
        help="comma-separated subset of: single, concurrent, second",
    )
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument(
        "--anchors",
        default="preload,plain",
        help="comma-separated subset of: preload (mlx_lm.server with the worker's LD_PRELOAD), "
        "plain (mlx_lm.server as started by hand)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="ARGS",
        help="also run our worker with these extra arguments, as one more column (e.g. "
        "'--speculation off': what a feature costs or gives, in the same run); repeatable",
    )
    return parser.parse_args()


def start_servers(model_dir: str, anchors: str, variants: list[str], tmp: Path) -> list[Server]:
    """Our worker (and its variants), then each anchor's ``mlx_lm.server``, all on
    ``model_dir``."""
    sys.path.insert(0, str(ROOT))
    from mesh.loopback_ports import free_port

    python = sys.executable
    servers = []
    for label, extra in [("ours", ""), *((f"ours {v}", v) for v in variants)]:
        port = free_port()
        command = [python, "-m", "worker", "--model", model_dir, "--port", str(port)]
        servers.append(start(label, command + shlex.split(extra), port, None, tmp))
    for label, env in anchor_commands(anchors.split(",")):
        port = free_port()
        command = [python, "-m", "mlx_lm.server", "--model", model_dir, "--port", str(port)]
        command += ["--log-level", "WARNING"]
        servers.append(start(label, command, port, model_dir, tmp, env))
    return servers


async def main() -> int:
    # `timeout`/Ctrl-C: unwind through the finally below so no server outlives the benchmark.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-worker-"))
    servers: list[Server] = []
    try:
        model_dir, model_label = pick_model(args.model, tmp)
        served_dir = float32_copy(model_dir, tmp)
        if served_dir != model_dir:
            model_label += (
                "; every server runs one float32 copy (quantized or half-precision stored)"
            )
        model_dir = served_dir
        print(f"model: {model_label}", flush=True)
        servers = start_servers(model_dir, args.anchors, args.variant, tmp)
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            await asyncio.gather(*(wait_ready(s, http) for s in servers))
            prefix, prefix_tokens = long_prefix(model_dir, args.prefix_tokens)
            results = {s.label: Measurements() for s in servers}
            for server in servers:  # warm-up: first compile/allocations are not measured
                await stream_chat(server, http, story_prompt(), 4)
            wanted = set(args.metrics.split(","))
            steps = [
                ("single", lambda s, m: single_stream(s, http, m, args.tokens)),
                ("concurrent", lambda s, m: concurrent(s, http, m, args.tokens)),
                ("second", lambda s, m: second_turn(s, http, m, prefix)),
            ]
            steps = [(name, step) for name, step in steps if name in wanted]
            for name, step in steps:
                for trial in range(args.trials):
                    # Rotate who goes first, so no server always follows the same one.
                    shift = trial % len(servers)
                    order = servers[shift:] + servers[:shift]
                    if trial % 2:
                        order = order[::-1]
                    for server in order:
                        await step(server, results[server.label])
                print(f"done: {name}", flush=True)
        text = report(model_label, results, args, prefix_tokens)
        print(text)
        if not args.no_write:
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            header = "# Worker benchmark results\n\nWritten by `bench/worker_vs_mlx_lm.py`.\n\n"
            if args.append and RESULTS.exists():
                RESULTS.write_text(RESULTS.read_text() + "\n" + text)
            else:
                RESULTS.write_text(header + text)
            print(f"wrote {RESULTS}")
        return 0
    finally:
        for server in servers:
            server.process.terminate()
        for server in servers:
            try:
                server.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.process.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
