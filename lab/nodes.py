"""Nodes of the fault lab: ``mesh up`` processes on loopback, each with its own home and ports.

The lab drives nodes only through the public surfaces a person would use: the ``mesh`` CLI
(``mesh up``; ``mesh invite`` as a fallback) and the gateway's HTTP API (``/health``,
``/v1/models``, ``POST /api/mesh/invite``).
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from lab.procs import ManagedProcess
from lab.scenario import NodeSpec
from mesh.loopback_ports import free_port
from mesh.membership.invite import decode_invite
from mesh.node_file import NodeFileError, read_node_file

# `python -c` rather than the console script: works from a checkout without an installed `mesh`.
# Node logs (node-N.log) carry the mesh's INFO lines with times: links, dials, refusals.
_LOGGING = (
    "import logging\n"
    "logging.basicConfig(level=logging.WARNING, "
    "format='%(asctime)s %(levelname)s %(name)s: %(message)s')\n"
    "logging.getLogger('mesh').setLevel(logging.INFO)\n"
)
MESH_MAIN = _LOGGING + "import sys; sys.argv[0] = 'mesh'; from mesh.cli import main; main()"
# What a lab node advertises (`mesh up --advertise`): not HOST:PORT, so peers skip it (the
# dialler drops what it cannot parse) and reach the node only through their static --peer
# addresses, i.e. the chaos proxies. Invites are rewritten to the joiner's proxy.
NO_DIRECT_ADDRESS = "lab-no-direct-dial"
REQUIRED_UP_FLAGS = (
    "--home",
    "--model",
    "--port",
    "--mesh-port",
    "--peer",
    "--join",
    "--no-discovery",
    "--advertise",
)


class LabError(RuntimeError):
    """The lab could not set up or drive its mesh; the message says which node and why."""


def mesh_argv(*args: str) -> list[str]:
    return [sys.executable, "-c", MESH_MAIN, *args]


def mesh_up_flags() -> set[str]:
    """The flags this checkout's ``mesh up`` accepts (from its --help)."""
    result = subprocess.run(
        mesh_argv("up", "--help"), capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        raise LabError(
            f"`mesh up --help` failed: {(result.stderr or result.stdout).strip()[-300:]}"
        )
    return set(re.findall(r"--[a-z][a-z0-9-]*", result.stdout))


def missing_up_flags(flags: set[str]) -> list[str]:
    return [flag for flag in REQUIRED_UP_FLAGS if flag not in flags]


def rewrite_invite(token: str, address: str) -> str:
    """The same invite, dialled at ``address`` (the joiner's proxy towards the inviter)."""
    invite = decode_invite(token)
    return invite.model_copy(update={"addresses": [address]}).encode()


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class LabNode:
    index: int
    spec: NodeSpec
    home: Path
    model_arg: str  # a directory (tiny models) or a store name for `mesh up --model`
    http_port: int = field(default_factory=free_port)
    mesh_port: int = field(default_factory=lambda: free_port(socket.SOCK_DGRAM))
    process: ManagedProcess | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def model_id(self) -> str:
        """The id the node serves its model under (a directory serves as its name)."""
        path = Path(self.model_arg)
        return path.name if path.is_dir() else self.model_arg

    @property
    def log_path(self) -> Path:
        return self.home / f"node-{self.index}.log"

    def running(self) -> bool:
        return self.process is not None and self.process.running()

    def up_argv(
        self, *, peers: list[str], join_token: str | None, flags: set[str], extra: list[str]
    ) -> list[str]:
        argv = mesh_argv(
            "up",
            "--home", str(self.home),
            *(["--model", self.model_arg] if self.spec.serves else ["--no-worker"]),
            "--port", str(self.http_port),
            "--mesh-port", str(self.mesh_port),
            "--no-discovery",
            "--advertise", NO_DIRECT_ADDRESS,
        )  # fmt: skip
        if "--host" in flags:
            argv += ["--host", "127.0.0.1"]
        if "--mesh-host" in flags:  # default is every interface: keep the lab on loopback
            argv += ["--mesh-host", "127.0.0.1"]
        for peer in peers:
            argv += ["--peer", peer]
        if join_token:
            argv += ["--join", join_token]
        return argv + extra

    def check_alive(self) -> None:
        if self.process is not None and not self.process.running():
            code = self.process.popen.returncode
            raise LabError(
                f"node {self.index} exited ({code}); log tail:\n{log_tail(self.log_path)}"
            )


async def wait_until(what: str, check, timeout_s: float, node: LabNode | None = None) -> None:
    """Poll ``check()`` (async, returns bool) every 0.25 s; LabError on timeout or node death."""
    deadline = time.monotonic() + timeout_s
    while True:
        if node is not None:
            node.check_alive()
        if await check():
            return
        if time.monotonic() > deadline:
            tail = f"; log tail:\n{log_tail(node.log_path)}" if node is not None else ""
            raise LabError(f"timed out after {timeout_s:g}s waiting for {what}{tail}")
        await asyncio.sleep(0.25)


async def listed_models(client: httpx.AsyncClient, node: LabNode) -> set[str]:
    try:
        response = await client.get(f"{node.url}/v1/models", timeout=5)
        if response.status_code != 200:
            return set()
        return {str(item["id"]) for item in response.json().get("data", [])}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return set()


async def healthy(client: httpx.AsyncClient, node: LabNode) -> bool:
    try:
        return (await client.get(f"{node.url}/health", timeout=5)).status_code == 200
    except httpx.HTTPError:
        return False


async def mint_invite(client: httpx.AsyncClient, node: LabNode) -> str:
    """An invite from ``node``: its HTTP API, else ``mesh invite --home`` (last stdout line)."""
    try:
        # Admin POSTs carry the node's CSRF token, which it writes to its node.json.
        csrf = str(read_node_file(node.home).get("csrf", ""))
        response = await client.post(
            f"{node.url}/api/mesh/invite",
            json={"ttl_s": 600},
            headers={"x-mesh-csrf": csrf},
            timeout=10,
        )
        if response.status_code == 200:
            return str(response.json()["token"])
    except (httpx.HTTPError, ValueError, KeyError, NodeFileError):
        pass  # fall back to the CLI below
    result = await asyncio.to_thread(
        subprocess.run,
        mesh_argv("invite", "--home", str(node.home)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        raise LabError(f"`mesh invite` on node {node.index} failed: {result.stderr.strip()[-300:]}")
    return lines[-1].strip()


async def build_tiny_models(paths: list[Path]) -> None:
    """Build in a child process: MLX never loads into the lab (its threads abort on Ctrl-C)."""
    code = "import sys; from worker.testing import make_tiny_model\nfor p in sys.argv[1:]: make_tiny_model(p)"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, *map(str, paths), stderr=asyncio.subprocess.PIPE
    )
    try:
        _, stderr = await process.communicate()
    finally:
        if process.returncode is None:  # cancelled (Ctrl-C): do not leave it running
            process.kill()
            await process.wait()
    if process.returncode != 0:
        raise LabError(f"building tiny models failed: {stderr.decode(errors='replace')[-500:]}")


async def node_status(client: httpx.AsyncClient, node: LabNode) -> dict:
    """``GET /api/status`` of a node, or {} when it does not answer."""
    try:
        response = await client.get(f"{node.url}/api/status", timeout=5)
        return response.json() if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def node_env(home: Path) -> dict[str, str]:
    """The environment a node process starts with (its home, unbuffered output)."""
    env = dict(os.environ)
    env["MLX_MESH_HOME"] = str(home)
    env["PYTHONUNBUFFERED"] = "1"
    # The lab's random-weight models loop under greedy decoding; its streams must go on.
    env.setdefault("MLX_MESH_LOOP_GUARD", "0")
    return env
