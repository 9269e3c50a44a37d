"""Real ``mesh`` processes for the end-to-end tests: ``mesh up`` nodes on loopback and one-shot
CLI commands, the same way a person runs them (a fresh interpreter per command)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson

MESH_ARGS = ["--port", "0", "--mesh-host", "127.0.0.1", "--mesh-port", "0", "--no-discovery"]


def mesh_command(*args: str) -> list[str]:
    return [sys.executable, "-c", "from mesh.cli import main; main()", *args]


def run_mesh(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """One CLI command to its end (wide columns, so rich tables do not fold ids)."""
    return subprocess.run(
        mesh_command(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200"},
    )


def wait_for(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, OSError, ValueError):
            value = predicate()
            if value:
                return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Running:
    """One ``mesh up`` subprocess, ready once it wrote ``node.json``."""

    def __init__(self, home: Path, *args: str) -> None:
        self.home = home
        self.last_words = ""
        self.process = subprocess.Popen(
            mesh_command("up", "--home", str(home), *MESH_ARGS, *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        node_file = home / "node.json"

        def ready():  # type: ignore[no-untyped-def]
            if self.process.poll() is not None:
                raise AssertionError(self.output())
            return node_file.exists() and orjson.loads(node_file.read_bytes())

        self.info = wait_for(ready, 180, f"node in {home}")
        self.url = self.info["url"]

    def output(self) -> str:
        return self.process.communicate(timeout=30)[0].decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL: no goodbye to anyone (its worker follows it: parent-death signal)."""
        self.process.kill()
        self.last_words = self.output()

    def stop(self) -> str:
        if self.process.returncode is not None:
            return self.last_words  # killed earlier
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        out = self.output()
        assert self.process.returncode == 0, out
        return out
