"""``mesh up --split 2``: a real node serves a model over two rank processes it supervises.
The gateway's answers at temperature 0 are the unsplit worker's; a rank stopped (SIGSTOP) or
killed mid-stream ends the stream with an error event in under 5 s, and the group re-forms;
meanwhile the model stays listed and a request for it is 503 with Retry-After, never 404."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from mesh.split import testing as split_testing
from worker.cpu.fast_path import REEXEC_MARKER
from worker.testing import make_tiny_model, run_worker_in_thread

mx = pytest.importorskip("mlx.core")
if not mx.distributed.is_available("ring"):
    pytest.skip("this MLX build has no ring backend (mx.distributed)", allow_module_level=True)
if sys.platform != "linux":
    pytest.skip("finds the rank processes through pgrep -P", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0}


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def followers(worker_pid: int, under: Path) -> list[int]:
    """The node's rank processes other than rank 0 (children of the node, not the worker) whose
    model lies under ``under`` (this test's, not those of a test running beside it)."""
    out = subprocess.run(
        ["pgrep", "-a", "-f", "worker.serve.split_rank --model"], capture_output=True, text=True
    ).stdout
    pids = [int(line.split()[0]) for line in out.splitlines() if f"--model {under}" in line]
    return [p for p in pids if p != worker_pid]


def answer(client: httpx.Client, model: str) -> str | None:
    try:
        response = client.post(
            "/v1/chat/completions", json={**CHAT, "model": model, "max_tokens": 6}
        )
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return response.json()["choices"][0]["message"]["content"]


def answer_or_503(client: httpx.Client, model: str) -> str | None:
    """The answer once the group serves; until then (None) a 503 with Retry-After, the model
    listed (a 404 would make an SDK give up)."""
    response = client.post("/v1/chat/completions", json={**CHAT, "model": model, "max_tokens": 6})
    assert model in [m["id"] for m in client.get("/v1/models").json()["data"]]
    if response.status_code == 200:
        return response.json()["choices"][0]["message"]["content"]
    assert response.status_code == 503 and response.headers.get("retry-after"), response.text
    return None


def stream_until_signal(client: httpx.Client, model: str, pid: int, sig: int) -> tuple[str, float]:
    body = {**CHAT, "model": model, "max_tokens": 100000, "stream": True}
    return split_testing.stream_until_signal(client, body, pid, sig)


def test_mesh_up_split_serves_fails_fast_and_reforms(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny6", num_layers=6)
    with run_worker_in_thread(model) as (base, _):
        with httpx.Client(base_url=base.removesuffix("/v1"), timeout=60) as client:
            expected = answer(client, "tiny6")
    assert expected

    home = tmp_path / "home"
    command = [sys.executable, "-c", "from mesh.cli import main; main()", "up", "--model",
               str(model), "--split", "2", "--port", "0", "--home", str(home),
               "--mesh-port", "0", "--no-discovery"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), REEXEC_MARKER: "1"}
    node = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    node_file = home / "node.json"
    try:

        def started() -> dict | None:
            assert node.poll() is None, node.communicate()[0].decode()
            return orjson.loads(node_file.read_bytes()) if node_file.exists() else None

        info = wait_for(started, 120, "node.json")
        with httpx.Client(base_url=info["url"], timeout=60) as client:
            assert answer(client, "tiny6") == expected  # through the gateway, split 3 + 3

            # A stopped rank: the step deadline (3 s) ends the group, the stream errs.
            worker = json.loads(node_file.read_text())["workers"]["tiny6"]["pid"]
            (follower,) = followers(worker, tmp_path)
            last, took = stream_until_signal(client, "tiny6", follower, signal.SIGSTOP)
            assert '"error"' in last and took < 5.0

            # Re-formed (the stopped rank is killed, both start again), same answers.
            reformed = wait_for(lambda: answer_or_503(client, "tiny6"), 120, "re-formed group")
            assert reformed == expected
            worker = json.loads(node_file.read_text())["workers"]["tiny6"]["pid"]
            (follower,) = followers(worker, tmp_path)
            last, took = stream_until_signal(client, "tiny6", follower, signal.SIGKILL)
            assert '"error"' in last and took < 5.0
            assert answer_or_503(client, "tiny6") is None  # still re-forming
            reformed = wait_for(lambda: answer_or_503(client, "tiny6"), 120, "re-formed again")
            assert reformed == expected
    finally:
        node.send_signal(signal.SIGTERM)
        out = node.communicate(timeout=60)[0].decode()
    assert node.returncode == 0, out
    assert "tiny6: 6 layers, 4096-token context, pipeline over 2 ranks" in out
    assert wait_for(lambda: not followers(-1, tmp_path), 10, "ranks to stop")
