"""Reliability figures from a fresh run (issue 11), against two real ``mesh up`` nodes on loopback.

- **Bad inputs**: every endpoint that takes a body gets malformed bodies – each top-level field
  (and each field of the first message/item) deleted or replaced by odd values (wrong types,
  huge numbers, NUL, emoji, deep nesting), unknown fields, non-JSON and non-object bodies.
  Counted: tried, answered 4xx, answered 5xx (must be 0); the node still answers after.
- **Pre-auth QUIC connections**: strangers with valid self-signed certificates that complete TLS
  and never authenticate: one more than the per-address cap. Counted: refused at once, held
  until the auth deadline, closed by it, still open after it (must be 0).
- **Forwarded cancels**: streams for node A's model sent to node B, abandoned after the first
  content chunk (a raw socket, closed for sure). Missed: A's worker still generating 1.5 s later.

A's worker is asked for its load with the secret its node gave it, read from the worker
process's environment (this machine's own process: a lab measurement, not a way in).

    python bench/reliability_figures.py [--cancels 100]   # writes bench/results/reliability-figures.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import orjson
from aioquic.asyncio import QuicConnectionProtocol, connect
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, QuicEvent

from mesh.identity import NodeIdentity
from mesh.loopback_ports import free_port
from mesh.tunnel.config import TunnelConfig

# Like for like with mlx-lm (and random-weight models that loop under greedy decoding):
# every answer runs to max_tokens, no loop guard (worker/engine/loop_guard.py).
os.environ.setdefault("MLX_MESH_LOOP_GUARD", "0")

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "reliability-figures.md"
USER = [{"role": "user", "content": "hi"}]
VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "tiny", "messages": USER, "max_tokens": 2},
    "/v1/responses": {"model": "tiny", "input": USER, "max_output_tokens": 2},
    "/v1/messages": {"model": "tiny", "messages": USER, "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": "tiny", "messages": USER},
}
ODD: list[Any] = [
    None, True, 0, -1, 2**70, 1e308, "", "x", "\u0000", "\U0001f642" * 50, [], [None], {},
    {"a": {"b": {}}}, [[[[[[]]]]]], {"type": "nope"},
]  # fmt: skip
RAW = [b"", b"{", b"[]", b"null", b'"x"', b"\xff\xfe", b"[" * 5000 + b"]" * 5000]


class Node:
    def __init__(self, home: Path, *args: str) -> None:
        self.home = home
        self.mesh_port = free_port(socket.SOCK_DGRAM)
        cmd = [sys.executable, "-c", "from mesh.cli import main; main()", "up", "--home", str(home)]
        cmd += ["--port", "0", "--mesh-host", "127.0.0.1", "--mesh-port", str(self.mesh_port)]
        cmd += ["--no-discovery", *args]
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while not (home / "node.json").exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"node in {home} did not start")
            time.sleep(0.2)
        self.info = orjson.loads((home / "node.json").read_bytes())
        self.url = self.info["url"]

    def stop(self) -> None:
        self.process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(30)
        if self.process.poll() is None:
            self.process.kill()


def _mutations(body: dict[str, Any]) -> list[dict[str, Any]]:
    out = [{**body, "unknown_field": {"x": 1}}]
    for key in body:
        out.append({k: v for k, v in body.items() if k != key})
        out += [{**body, key: odd} for odd in ODD]
    for key in ("messages", "input"):
        if isinstance(body.get(key), list):
            first = body[key][0]
            for field in first:
                out += [{**body, key: [{**first, field: odd}]} for odd in ODD]
    return out


def bad_inputs(url: str) -> dict[str, Any]:
    statuses: Counter[int] = Counter()
    server_errors: list[str] = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for path, valid in VALID.items():
            bodies = [json.dumps(b).encode() for b in _mutations(valid)] + RAW
            for stream in (False, True):
                for raw in bodies:
                    if stream and raw.startswith(b"{") and raw.endswith(b"}") and len(raw) > 2:
                        raw = raw[:-1] + b',"stream":true}'
                    status = client.post(path, content=raw, headers={"content-type": "application/json"}).status_code  # fmt: skip
                    statuses[status] += 1
                    if status >= 500:
                        server_errors.append(f"{path} {status} {raw[:80]!r}")
        alive = client.post("/v1/chat/completions", json=VALID["/v1/chat/completions"])
    return {
        "tried": sum(statuses.values()),
        "statuses": dict(sorted(statuses.items())),
        "5xx": server_errors,
        "still_serving": alive.status_code == 200,
    }


class _Silent(QuicConnectionProtocol):
    """Completes TLS, then says nothing; records how the server closed it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.closed_at: float | None = None

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ConnectionTerminated) and self.closed_at is None:
            self.closed_at = time.monotonic()


async def preauth(port: int) -> dict[str, Any]:
    config = TunnelConfig()
    identity = NodeIdentity.generate()
    quic = QuicConfiguration(is_client=True, alpn_protocols=["mlx-mesh/1"])
    quic.verify_mode = ssl.CERT_NONE
    quic.certificate, quic.private_key = identity.certificate, identity.private_key
    opened = config.max_preauth_per_address + 1
    t0 = time.monotonic()
    async with contextlib.AsyncExitStack() as stack:
        strangers = []
        for _ in range(opened):
            strangers.append(
                await stack.enter_async_context(
                    connect("127.0.0.1", port, configuration=quic, create_protocol=_Silent)
                )
            )
        await asyncio.sleep(1.0)
        refused = sum(1 for s in strangers if s.closed_at is not None)
        await asyncio.sleep(config.auth_deadline + 2.0)
        closed = [s.closed_at - t0 for s in strangers if s.closed_at is not None]
        still_open = opened - len(closed)
    return {
        "opened": opened,
        "refused_at_once": refused,
        "held_until_deadline": opened - refused,
        "closed_by_deadline": len(closed) - refused,
        "still_open_after": still_open,
        "latest_close_s": round(max(closed), 1) if closed else None,
        "deadline_s": config.auth_deadline,
    }


def _worker_secret(pid: int) -> str:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    for entry in environ:
        if entry.startswith(b"MLX_MESH_WORKER_SECRET="):
            return entry.split(b"=", 1)[1].decode()
    return ""


def _worker_in_flight(worker: dict[str, Any], secret: str) -> int:
    headers = {"authorization": f"Bearer {secret}"} if secret else {}
    health = httpx.get(worker["url"].removesuffix("/v1") + "/health", headers=headers, timeout=5)
    return int(health.json()["in_flight"])


def _abandon(url: str) -> None:
    body = orjson.dumps(
        {"model": "tiny", "messages": USER, "max_tokens": 4000, "stream": True, "temperature": 0}
    )
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        seen = b""
        while b'"content"' not in seen:
            chunk = sock.recv(65536)
            if not chunk:
                raise SystemExit(f"the stream ended before its first token: {seen[-200:]!r}")
            seen += chunk


def cancels(b_url: str, worker: dict[str, Any], tries: int) -> dict[str, Any]:
    secret = _worker_secret(int(worker["pid"]))
    missed: list[int] = []
    for i in range(tries):
        _abandon(b_url)
        deadline = time.monotonic() + 1.5
        while _worker_in_flight(worker, secret) and time.monotonic() < deadline:
            time.sleep(0.02)
        if _worker_in_flight(worker, secret):
            missed.append(i)
            while _worker_in_flight(worker, secret):  # let it end before the next try
                time.sleep(0.1)
    return {"tried": tries, "missed": len(missed), "missed_tries": missed}


def report(figures: dict[str, Any]) -> str:
    bad, pre, cancel = figures["bad_inputs"], figures["preauth"], figures["cancels"]
    lines = [
        "# Reliability figures",
        "",
        f"Fresh run of `python bench/reliability_figures.py --cancels {cancel['tried']}` at commit"
        f" `{figures['commit']}`, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs: two real"
        " `mesh up` nodes on loopback, A with the tiny random-weight model, B (no worker) joined"
        " to A by invite.",
        "",
        "| figure | result |",
        "|---|---|",
        f"| bad inputs tried / 5xx | {bad['tried']} / **{len(bad['5xx'])}** (statuses:"
        f" {', '.join(f'{k}: {v}' for k, v in bad['statuses'].items())}); node still serving:"
        f" {'yes' if bad['still_serving'] else 'NO'} |",
        f"| pre-auth QUIC connections opened / refused at once / held / closed by the"
        f" {pre['deadline_s']:.0f} s deadline / still open | {pre['opened']} / {pre['refused_at_once']}"
        f" / {pre['held_until_deadline']} / {pre['closed_by_deadline']} /"
        f" **{pre['still_open_after']}** (last closed {pre['latest_close_s']} s after opening) |",
        f"| forwarded cancels tried / missed (A's worker still generating 1.5 s after the client"
        f" left) | {cancel['tried']} / **{cancel['missed']}** |",
        "",
    ]
    if bad["5xx"]:
        lines += ["5xx answers:", "", *(f"- `{e}`" for e in bad["5xx"][:20]), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cancels", type=int, default=100)
    args = parser.parse_args()
    from worker.testing import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-figures-") as tmp:
        model = make_tiny_model(Path(tmp) / "tiny")
        a = Node(Path(tmp) / "a", "--model", str(model))
        b = None
        try:
            invite = subprocess.run(
                [sys.executable, "-c", "from mesh.cli import main; main()", "invite", "--home",
                 str(a.home)], capture_output=True, text=True, timeout=60, check=True,
            )  # fmt: skip
            b = Node(Path(tmp) / "b", "--no-worker", "--join", invite.stdout.split()[-1])
            deadline = time.monotonic() + 60
            while "tiny" not in [m["id"] for m in httpx.get(b.url + "/v1/models").json()["data"]]:
                if time.monotonic() > deadline:
                    raise SystemExit("B never saw A's model")
                time.sleep(0.2)
            figures = {
                "commit": subprocess.run(
                    ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
                ).stdout.strip(),
                "bad_inputs": bad_inputs(a.url),
                "preauth": asyncio.run(preauth(a.mesh_port)),
                "cancels": cancels(b.url, a.info["workers"]["tiny"], args.cancels),
            }
        finally:
            if b is not None:
                b.stop()
            a.stop()
    text = report(figures)
    print(text)
    RESULTS.write_text(text)
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
