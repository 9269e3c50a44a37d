"""Split groups on one box, for tests and benches: rank processes on loopback, and two
"nodes" (two identities) whose ranks talk only through the pinned-TLS bridge.

Shared so that the end-to-end tests and ``bench/split.py`` start groups the same way."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from mesh.copy.tls import cert_der
from mesh.identity import NodeIdentity
from mesh.loopback_ports import free_ports
from mesh.split.bridge import BridgeLink, BridgeServer

__all__ = ["bridged_hostfiles", "serve_split", "spawn_ranks", "stream_until_signal"]

Hostfiles = dict[int, list[list[str]]]


def spawn_ranks(
    command: Sequence[str],
    split: Sequence[int],
    workdir: Path,
    env: dict[str, str],
    hostfiles: Hostfiles | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Start one ``command --split ...`` process per rank (stdout piped), rank 0 first, each
    with its ``MLX_RANK`` and its hostfile written under ``workdir``. ``hostfiles``: each rank's
    own (by default one shared, every rank on a fresh loopback port)."""
    if hostfiles is None:
        shared = [[f"127.0.0.1:{p}"] for p in free_ports(len(split))]
        hostfiles = dict.fromkeys(range(len(split)), shared)
    split_arg = ",".join(map(str, split))
    procs = []
    for rank in range(len(split)):
        hostfile = workdir / f"hosts-{rank}.json"
        hostfile.write_text(json.dumps(hostfiles[rank]))
        rank_env = {**env, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        procs.append(
            subprocess.Popen([*command, "--split", split_arg], env=rank_env, stdout=subprocess.PIPE)
        )
    return procs


def serve_split(
    model: Path, split: Sequence[int], workdir: Path, env: dict[str, str]
) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """A split group on loopback whose rank 0 serves the worker API (warm-up on, as ``mesh
    up`` runs it): its ``/v1`` URL once it listens, and the rank processes, rank 0 first."""
    (port,) = free_ports(1)
    command = [sys.executable, "-m", "worker.serve.split_rank", "--model", str(model), "--serve"]
    procs = spawn_ranks([*command, "--port", str(port)], split, workdir, env)
    assert procs[0].stdout is not None
    for line in procs[0].stdout:
        if b"worker listening on" in line:
            return f"http://127.0.0.1:{port}/v1", procs
    raise RuntimeError(f"rank 0 did not start (exit {procs[0].wait(30)})")


@contextlib.contextmanager
def bridged_hostfiles() -> Iterator[Hostfiles]:
    """Two "nodes" (two identities, a bridge server each, a link each way, served from a loop
    in a background thread): rank 0 on node a, rank 1 on node b. Yields the two ranks'
    hostfiles, each listing its own loopback port and a local link for the other rank, so all
    ring traffic crosses the TLS bridge; closes every part on exit."""
    own = free_ports(2)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    parts: list[Any] = []

    async def start() -> tuple[int, int]:
        a, b = NodeIdentity.generate(), NodeIdentity.generate()
        server_a = BridgeServer(a, trusted=lambda: [cert_der(b)])
        server_b = BridgeServer(b, trusted=lambda: [cert_der(a)])
        parts.extend([server_a, server_b])
        port_a, port_b = await server_a.start("127.0.0.1"), await server_b.start("127.0.0.1")
        server_a.register("g", 0, own[0])
        server_b.register("g", 1, own[1])
        to_b = BridgeLink(a, ("127.0.0.1", port_b), cert_der(b), b.node_id, "g", 1)
        to_a = BridgeLink(b, ("127.0.0.1", port_a), cert_der(a), a.node_id, "g", 0)
        parts.extend([to_b, to_a])
        return await to_b.start(), await to_a.start()

    async def stop() -> None:
        for part in parts:
            await part.close()

    try:
        link_to_b, link_to_a = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
        yield {
            0: [[f"127.0.0.1:{own[0]}"], [f"127.0.0.1:{link_to_b}"]],
            1: [[f"127.0.0.1:{link_to_a}"], [f"127.0.0.1:{own[1]}"]],
        }
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def stream_until_signal(client: Any, body: dict[str, Any], pid: int, sig: int) -> tuple[str, float]:
    """Stream ``body`` (a long Chat Completions answer) through ``client`` (an
    ``httpx.Client`` on a gateway) and send ``sig`` to ``pid`` (a rank) after the first token:
    the last SSE data line, and how long after the signal the stream ended."""
    sent_at = None
    last = ""
    with client.stream("POST", "/v1/chat/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = line
            if sent_at is None and line.startswith("data: {"):
                os.kill(pid, sig)
                sent_at = time.monotonic()
    assert sent_at is not None, "the stream never started"
    return last, time.monotonic() - sent_at
