"""What the gateway adds on top of the engine: TTFT and CPU per streamed token, per API.

Baseline: the same scripted engine (``ScriptedUpstream``, no delays) served by a minimal
Starlette SSE app that writes one ``data:`` frame per token. Candidate: the full gateway
(``create_app``: parsing, router, producer task, API encoder, metrics). Each server runs in its
own process; CPU is that process's user+system time over the streaming runs, divided by the
tokens it streamed. Writes bench/results/gateway.md.

    python bench/gateway_overhead.py [--tokens 256] [--runs 20] [--ttft-runs 60]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.upstream import Upstream  # noqa: E402

APIS = {
    "chat": (
        "/v1/chat/completions",
        lambda n: {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "max_tokens": n,
        },
    ),
    "responses": (
        "/v1/responses",
        lambda n: {"model": "m", "input": "x", "stream": True, "max_output_tokens": n},
    ),
    "messages": (
        "/v1/messages",
        lambda n: {
            "model": "m",
            "max_tokens": n,
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
        },
    ),
}


def _script(tokens: int) -> list:
    """One token per event; the engine yields to the loop between tokens, as a real one does,
    so neither server can batch tokens it has not been given yet."""
    from gateway.events import Done, TextDelta, Usage
    from gateway.testing import Sleep

    steps: list = []
    for _ in range(tokens):
        steps += [Sleep(0), TextDelta(" tok")]
    return [*steps, Usage(5, tokens), Done("stop")]


def _cpu_route():
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def cpu(request):
        return JSONResponse({"cpu_s": time.process_time()})

    return Route("/_cpu", cpu)


def make_direct_app():
    """The baseline: engine events → one chat-style data frame per token, nothing else."""
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from gateway.events import TextDelta
    from gateway.request import ChatRequest, Message
    from gateway.testing import ScriptedUpstream

    async def generate(request):
        body = orjson.loads(await request.body())
        tokens = body.get("max_tokens") or body.get("max_output_tokens")
        upstream = ScriptedUpstream.of(*_script(tokens))
        chat = ChatRequest(model="m", messages=[Message(role="user", content="x")])

        async def frames():
            async for event in upstream.stream(chat):
                if isinstance(event, TextDelta):
                    yield (
                        b"data: "
                        + orjson.dumps({"choices": [{"delta": {"content": event.text}}]})
                        + b"\n\n"
                    )
            yield b"data: [DONE]\n\n"

        return StreamingResponse(frames(), media_type="text/event-stream")

    routes = [Route(path, generate, methods=["POST"]) for path, _ in APIS.values()]
    return Starlette(routes=[*routes, _cpu_route()])


class _TokenCountingUpstream(Upstream):
    """Plays a script sized by the request's max_tokens (so one app serves every size)."""

    name = "local"

    def stream(self, request):
        from gateway.testing import ScriptedUpstream

        return ScriptedUpstream.of(*_script(request.max_tokens or 16)).stream(request)


def make_gateway_app():
    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from gateway.upstream import ModelInfo, StaticDirectory

    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), _TokenCountingUpstream())
    return create_app(directory, GatewayConfig(), extra_routes=[_cpu_route()])


def serve(kind: str, port_file: Path) -> None:
    import socket

    import uvicorn

    app = make_direct_app() if kind == "direct" else make_gateway_app()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port_file.write_text(str(sock.getsockname()[1]))
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])


def _start(kind: str, tmp: Path) -> tuple[subprocess.Popen, str]:
    port_file = tmp / f"{kind}.port"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind, "--port-file", str(port_file)]
    )
    url = None
    for _ in range(300):
        if port_file.exists() and port_file.read_text():
            url = f"http://127.0.0.1:{port_file.read_text()}"
            try:
                httpx.get(url + "/_cpu", timeout=1)
                break
            except httpx.HTTPError:
                pass
        time.sleep(0.05)
    assert url, f"{kind} server did not start"
    return proc, url


# What one content frame carries in each API (the direct app writes chat-style frames).
MARKERS = {
    "chat": b'"content":" tok"',
    "responses": b'"delta":" tok"',
    "messages": b'"text":" tok"',
}
DIRECT_MARKER = b'"content":" tok"'


def _stream_once(url: str, api: str, tokens: int, marker: bytes) -> tuple[float, int]:
    """Seconds to the first content frame, and content frames seen.

    A raw socket with TCP_NODELAY and the request in one write: an HTTP client that writes
    headers and body separately meets delayed ACKs and adds ~40 ms to both sides.
    """
    path, body = APIS[api]
    payload = orjson.dumps(body(tokens))
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        sock.sendall(head + payload)
        ttft = None
        received = bytearray()
        while chunk := sock.recv(65536):
            if ttft is None and marker in chunk:
                ttft = time.perf_counter() - t0
            received += chunk
    assert ttft is not None, f"no content from {url}{path}: {bytes(received[:300])!r}"
    return ttft, received.count(marker)


def _cpu(url: str) -> float:
    return httpx.get(url + "/_cpu").json()["cpu_s"]


def measure_ttft(urls: dict[str, str], api: str, runs: int) -> dict[str, list[float]]:
    """One-token streams, alternating between the servers so load changes hit both alike."""
    markers = {"direct": DIRECT_MARKER, "gateway": MARKERS[api]}
    for kind, url in urls.items():
        for _ in range(5):  # warm up
            _stream_once(url, api, 4, markers[kind])
    samples: dict[str, list[float]] = {kind: [] for kind in urls}
    for _ in range(runs):
        for kind, url in urls.items():
            samples[kind].append(_stream_once(url, api, 1, markers[kind])[0])
    return {kind: sorted(values) for kind, values in samples.items()}


def measure_cpu(url: str, api: str, tokens: int, runs: int, marker: bytes) -> float:
    """Server process CPU seconds per streamed token."""
    cpu0 = _cpu(url)
    streamed = sum(_stream_once(url, api, tokens, marker)[1] for _ in range(runs))
    cpu1 = _cpu(url)
    assert streamed == tokens * runs, (streamed, tokens * runs)
    return (cpu1 - cpu0) / streamed


async def _first_content_in_process(app, api: str, marker: bytes) -> float:
    """Seconds from calling the ASGI app to the send() that carries the first content frame."""
    path, body = APIS[api]
    raw = orjson.dumps(body(1))
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
    }  # fmt: skip
    done = asyncio.Event()
    first: list[float] = []

    async def receive() -> dict:
        if not first and not done.is_set() and not getattr(receive, "sent", False):
            receive.sent = True  # type: ignore[attr-defined]
            return {"type": "http.request", "body": raw, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            if not first and marker in message.get("body", b""):
                first.append(time.perf_counter())
            if not message.get("more_body", False):
                done.set()

    t0 = time.perf_counter()
    await app(scope, receive, send)
    return first[0] - t0


def measure_ttft_in_process(api: str, runs: int) -> dict[str, list[float]]:
    """The same TTFT without sockets or uvicorn: the gateway's own added work, less noise."""
    apps = {
        "direct": (make_direct_app(), DIRECT_MARKER),
        "gateway": (make_gateway_app(), MARKERS[api]),
    }

    async def run() -> dict[str, list[float]]:
        samples: dict[str, list[float]] = {kind: [] for kind in apps}
        for i in range(runs + 20):
            for kind, (app, marker) in apps.items():
                value = await _first_content_in_process(app, api, marker)
                if i >= 20:  # warm-up
                    samples[kind].append(value)
        return {kind: sorted(v) for kind, v in samples.items()}

    return asyncio.run(run())


def _p(values: list[float], q: float) -> float:
    return values[int(q * (len(values) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", choices=["direct", "gateway"])
    parser.add_argument("--port-file", type=Path)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--ttft-runs", type=int, default=60)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gateway.md")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port_file)
        return
    import tempfile

    tmp = Path(tempfile.mkdtemp())
    procs = []
    try:
        direct, direct_url = _start("direct", tmp)
        procs.append(direct)
        gateway, gateway_url = _start("gateway", tmp)
        procs.append(gateway)
        rows = []
        in_process = []
        for api in APIS:
            ttft = measure_ttft({"direct": direct_url, "gateway": gateway_url}, api, args.ttft_runs)
            cpu_direct = measure_cpu(direct_url, api, args.tokens, args.runs, DIRECT_MARKER)
            cpu_gateway = measure_cpu(gateway_url, api, args.tokens, args.runs, MARKERS[api])
            rows.append((api, ttft, cpu_direct, cpu_gateway))
            in_process.append((api, measure_ttft_in_process(api, args.ttft_runs * 2)))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
    lines = [
        "# Gateway overhead",
        "",
        f"Scripted engine, {args.tokens} tokens/stream × {args.runs} streams per API (CPU), "
        f"{args.ttft_runs} one-token streams per API (TTFT); baseline = minimal Starlette SSE app "
        "over the same engine; each server in its own process; client on the same machine. "
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs. Targets: added TTFT p50 ≤ 2 ms, "
        "gateway CPU ≤ 30 µs/token.",
        "",
        "| API | TTFT p50 direct → gateway (added) | TTFT p95 direct → gateway (added) | CPU/token direct → gateway (ratio) |",
        "|---|---|---|---|",
    ]
    missed = []
    for api, ttft, cpu_d, cpu_g in rows:
        d, g = ttft["direct"], ttft["gateway"]
        cells = []
        for q in (0.5, 0.95):
            a, b = _p(d, q) * 1e3, _p(g, q) * 1e3
            cells.append(f"{a:.2f} → {b:.2f} ms ({b - a:+.2f} ms)")
        cells.append(
            f"{cpu_d * 1e6:.1f} → {cpu_g * 1e6:.1f} µs ({(cpu_g - cpu_d) * 1e6:+.1f} µs, {cpu_g / cpu_d:.2f}×)"
        )
        lines.append(f"| {api} | " + " | ".join(cells) + " |")
        added_p50_ms = (_p(g, 0.5) - _p(d, 0.5)) * 1e3
        if added_p50_ms > 2.0:
            missed.append(f"{api} added TTFT p50 {added_p50_ms:+.2f} ms")
        if cpu_g * 1e6 > 30.0:
            missed.append(f"{api} gateway CPU {cpu_g * 1e6:.1f} µs/token")
    verdict = "met" if not missed else "NOT met in this run: " + "; ".join(missed)
    lines += ["", f"Targets (over HTTP): **{verdict}**."]
    lines += [
        "",
        "In-process (ASGI call → first content frame handed to the server; no sockets, no uvicorn):",
        "",
        "| API | p50 direct → gateway (added) | p95 direct → gateway (added) |",
        "|---|---|---|",
    ]
    for api, ttft in in_process:
        d, g = ttft["direct"], ttft["gateway"]
        cells = []
        for q in (0.5, 0.95):
            a, b = _p(d, q) * 1e3, _p(g, q) * 1e3
            cells.append(f"{a:.3f} → {b:.3f} ms ({b - a:+.3f} ms)")
        lines.append(f"| {api} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "CPU/token is the whole server process (uvicorn + app + engine) over the streaming runs;",
        "the gateway column is what the target applies to. The engine yields to the event loop",
        "between tokens, so neither server can batch tokens it has not been given yet.",
        f"Load average while running: {os.getloadavg()[0]:.1f} (shared machine: p95 is noisy).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
