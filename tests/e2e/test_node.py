"""``mesh up`` end to end: a real node (subprocess) with the tiny model – serves the SDKs,
restarts a killed worker, and on SIGTERM stops everything and removes node.json."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from gateway.config import GatewayConfig
from mesh.errors import NodeError
from mesh.node import NodeConfig


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child of the (dead) node still "exists"; check its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(predicate, timeout: float = 120.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_non_loopback_without_key_is_refused(tmp_path):
    with pytest.raises(NodeError, match="API key"):
        NodeConfig(home=tmp_path, models=("m",), host="0.0.0.0").check()
    NodeConfig(
        home=tmp_path,
        models=("m",),
        host="0.0.0.0",
        gateway=GatewayConfig(api_key="a-long-enough-key"),
    ).check()


@pytest.mark.parametrize(
    ("host", "key"), [("0.0.0.0", "k"), ("0.0.0.0", " " * 20), ("127.0.0.1", "  ")]
)
def test_weak_or_blank_api_keys_are_refused(tmp_path, host, key):
    with pytest.raises(NodeError, match="API key"):
        NodeConfig(
            home=tmp_path, models=("m",), host=host, gateway=GatewayConfig(api_key=key)
        ).check()


@pytest.mark.skipif(sys.platform != "linux", reason="checks worker state through /proc")
def test_mesh_up_serves_restarts_and_stops_clean(tiny_model_dir, tmp_path):
    home = tmp_path / "home"
    command = [sys.executable, "-c", "from mesh.cli import main; main()", "up"]
    command += ["--model", str(tiny_model_dir), "--port", "0", "--home", str(home)]
    command += ["--mesh-port", "0", "--no-discovery"]  # a private one-node mesh
    node = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    node_file = home / "node.json"

    def started() -> dict | None:
        assert node.poll() is None, node.communicate()[0].decode()
        return orjson.loads(node_file.read_bytes()) if node_file.exists() else None

    try:
        info = _wait_for(started, what="node.json")
        assert info["pid"] == node.pid and info["models"] == ["model"]
        client = openai.OpenAI(
            base_url=info["url"] + "/v1",
            api_key="k",
            _strict_response_validation=True,
            max_retries=0,
        )
        assert "model" in [m.id for m in client.models.list()]  # (+ "mesh" when MoA is on)
        completion = client.chat.completions.create(
            model="model", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert completion.usage.completion_tokens == 3
        # The worker's own port is no side door past the gateway: it wants the node's secret.
        worker_url = info["workers"]["model"]["url"]
        for path in ("/v1/models", "/health"):
            refused = httpx.get(worker_url + path, timeout=5)
            assert refused.status_code == 401, path
        assert "url" not in orjson.dumps(httpx.get(info["url"] + "/health").json()).decode()
        # The worker's speculation counters reach the gateway's /metrics (the node polls them).
        spec = 'gateway_worker_speculation_drafted_tokens_total{model="model"}'
        _wait_for(lambda: spec in httpx.get(info["url"] + "/metrics").text, 30, "metrics")

        worker_pid = info["workers"]["model"]["pid"]
        os.kill(worker_pid, signal.SIGKILL)
        _wait_for(lambda: not _alive(worker_pid), 30, "worker death")

        def served() -> bool:
            try:
                client.chat.completions.create(
                    model="model", messages=[{"role": "user", "content": "x"}], max_tokens=2
                )
            except openai.APIError:
                return False
            return True

        _wait_for(served, 120, "restarted worker")
        health = client.get("/../health", cast_to=object)
        assert health["workers"]["model"]["restarts"] == 1
        new_worker_pid = int(
            subprocess.run(
                ["pgrep", "-f", "-P", str(node.pid), "worker"], capture_output=True, text=True
            ).stdout.split()[0]
        )
        client.close()
    finally:
        node.send_signal(signal.SIGTERM)
        out = node.communicate(timeout=30)[0].decode()
    assert node.returncode == 0, out
    assert "mlx-mesh gateway on http://127.0.0.1:" in out
    assert not node_file.exists()
    _wait_for(lambda: not _alive(new_worker_pid), 10, "worker stop")


def test_unpulled_store_model_is_refused_in_words(tmp_path):
    from mesh.workers import check_model_available

    with pytest.raises(NodeError, match="mesh models pull smollm2-135m"):
        check_model_available(tmp_path, "smollm2-135m")
    check_model_available(tmp_path, "mlx-community/some-model")  # hub ids go to the worker
    # A name nobody can pull gets no advice to pull it.
    with pytest.raises(NodeError, match="not a known model") as refused:
        check_model_available(tmp_path, "llama-9000")
    assert "models pull" not in str(refused.value)


async def test_worker_that_cannot_load_fails_the_start_and_leaves_nothing(tmp_path):
    from mesh.node import Node
    from mesh.service import MeshConfig

    not_a_model = tmp_path / "empty-model"
    not_a_model.mkdir()
    config = NodeConfig(home=tmp_path / "home", models=(str(not_a_model),), port=0)
    node = Node(config, MeshConfig(port=0, discovery=False))
    with pytest.raises(NodeError, match="before it was ready"):
        await node.run()
    assert node.workers.processes[0].process.returncode is not None
    assert not (tmp_path / "home" / "node.json").exists()
