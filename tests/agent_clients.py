"""Real agent harnesses (Claude Code, OpenCode) for the end-to-end tests: where their binaries
are, a scripted gateway for them to talk to, and running them with a fresh HOME.

The binaries come from ``$MLX_MESH_CLIENTS`` (an npm prefix, or the folder holding them), else
from ``.cache/clients`` (``make clients`` installs them there with npm); a test module whose
client is missing skips with the reason.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.testing import HttpRecorder, ServerThread
from gateway.upstream import ModelInfo, StaticDirectory, Upstream

ROOT = Path(__file__).parents[1]
CLIENTS = ROOT / ".cache" / "clients"
RUN_TIMEOUT_S = 90  # a client that cannot reach its server hangs until its own retries end


def client_binary(name: str) -> Path | None:
    """The installed ``name`` (``claude``, ``opencode``), or None."""
    places = []
    if custom := os.environ.get("MLX_MESH_CLIENTS"):
        places += [Path(custom) / "node_modules" / ".bin", Path(custom)]
    places.append(CLIENTS / "node_modules" / ".bin")
    for place in places:
        if os.access(place / name, os.X_OK):
            return place / name
    return None


def require_client(name: str, package: str) -> Path:
    """The binary, or skip the calling test module saying how to install it."""
    binary = client_binary(name)
    if binary is None:
        pytest.skip(
            f"no {name} binary: run `make clients` (npm install --prefix .cache/clients "
            f"{package}) or set MLX_MESH_CLIENTS to an npm prefix that has it",
            allow_module_level=True,
        )
    return binary


@dataclass
class ScriptedGateway:
    """A gateway on loopback over a scripted upstream, with what the client did to it."""

    url: str
    recorder: HttpRecorder
    request_log: Path

    def failures(self) -> list[str]:
        """Every 4xx/5xx: exchanges the recorder saw (any path) and request-log rows."""
        seen = [
            f"{e.method} {e.path} → {e.status}" for e in self.recorder.exchanges if e.status >= 400
        ]
        if self.request_log.exists():
            rows = [orjson.loads(line) for line in self.request_log.read_bytes().splitlines()]
            seen += [
                f"log: {r['api']} {r['status']} {r['outcome']}" for r in rows if r["status"] >= 400
            ]
        return seen


@contextmanager
def scripted_gateway(
    upstream: Upstream, model: str, tmp_path: Path, *, api_key: str
) -> Iterator[ScriptedGateway]:
    directory = StaticDirectory()
    directory.add(ModelInfo(id=model), upstream)
    log = tmp_path / "requests.jsonl"
    recorder = HttpRecorder(create_app(directory, GatewayConfig(api_key=api_key, request_log=log)))
    with ServerThread(recorder) as server:
        yield ScriptedGateway(server.url, recorder, log)


def run_client(
    argv: Sequence[str | Path], *, home: Path, cwd: Path, env: Mapping[str, str]
) -> subprocess.CompletedProcess[str]:
    """Run a client with a fresh HOME and only the environment given (none of the developer's
    keys or settings leak in), stdin closed; a hang fails the test with what it printed."""
    home.mkdir(parents=True, exist_ok=True)
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "TERM": "dumb"}
    try:
        return subprocess.run(
            [str(a) for a in argv],
            cwd=cwd,
            env={**base, **env},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{argv[0]} hung for {RUN_TIMEOUT_S} s; stdout: {exc.stdout!r:.2000}")
