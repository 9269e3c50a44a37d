"""One model split across real ``mesh up`` processes on loopback (MLX ring through the bridge).

B (and C) offer memory (``--share-memory``) and serve nothing; A serves the tiny model from its
store split over them (``--split-over``). A's rank 0 serves the worker API; the other ranks run
on B (and C), which copy only the files their layers need from A. At temperature 0 every API on
A, and a forwarded route through B, answer as the unsplit model does; a remote rank killed or
stopped mid-stream ends the stream with an error event in under 5 s and the group re-forms;
B's node gone leaves the model waiting for memory, and B back re-forms the group. While the
group is broken, re-forming or waiting, the model stays listed in /v1/models (its state in
/api/status) and a request for it is 503 with Retry-After, never 404 (SDKs retry a 503 only).
Strangers get nothing from the bridge."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from mesh_processes import Running, run_mesh, wait_for

from mesh.copy.tls import make_context
from mesh.identity import NodeIdentity
from mesh.split import testing as split_testing
from worker.store import model_path
from worker.testing import make_tiny_model, run_worker_in_thread

mx = pytest.importorskip("mlx.core")
if not mx.distributed.is_available("ring"):
    pytest.skip("this MLX build has no ring backend (mx.distributed)", allow_module_level=True)
if sys.platform != "linux":
    pytest.skip("finds rank processes with pgrep", allow_module_level=True)

PROMPT = "Hi"
CHAT = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 6}


def rank_pids(under: Path) -> list[int]:
    """Follower rank processes whose model lies under ``under`` (this test's, not those of a test
    running beside it); rank 0 runs with --serve first, so it does not match."""
    out = subprocess.run(
        ["pgrep", "-a", "-f", "worker.serve.split_rank --model"], capture_output=True, text=True
    ).stdout
    return [int(line.split()[0]) for line in out.splitlines() if f"--model {under}" in line]


def chat(url: str) -> str | None:
    try:
        response = httpx.post(
            url + "/v1/chat/completions", json={**CHAT, "model": "tiny6"}, timeout=60
        )
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return response.json()["choices"][0]["message"]["content"]


def served_or_503(url: str) -> str | None:
    """The answer once the model serves again; until then (None) every request for it must be
    503 with Retry-After and the model listed – never a 404, which an SDK does not retry."""
    response = httpx.post(url + "/v1/chat/completions", json={**CHAT, "model": "tiny6"}, timeout=60)
    listed = [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]]
    assert "tiny6" in listed, listed
    if response.status_code == 200:
        return response.json()["choices"][0]["message"]["content"]
    assert response.status_code == 503, (response.status_code, response.text)
    assert response.headers.get("retry-after"), response.headers
    return None


class Outage(threading.Thread):
    """Asks for the model every 0.3 s until stopped, with :func:`served_or_503`'s rule: what
    broke it is kept in ``failure`` (checked by the test, in its own thread)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.asked = 0
        self.failure: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.3):
            try:
                served_or_503(self.url)
                self.asked += 1
            except httpx.HTTPError:
                continue  # not this test's business: the gateway's own connection
            except AssertionError as exc:
                self.failure = exc
                return

    def finish(self) -> None:
        self.done.set()
        self.join(70)
        assert self.failure is None, self.failure
        assert self.asked > 0


def responses_text(url: str) -> str:
    body = {"model": "tiny6", "input": PROMPT, "temperature": 0, "max_output_tokens": 6}
    response = httpx.post(url + "/v1/responses", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["output"][-1]["content"][0]["text"]


def messages_text(url: str) -> str:
    body = {**CHAT, "model": "tiny6"}
    response = httpx.post(url + "/v1/messages", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["content"][0]["text"]


def stream_until_signal(url: str, pid: int, sig: int) -> tuple[str, float]:
    body = {**CHAT, "model": "tiny6", "max_tokens": 100000, "stream": True}
    with httpx.Client(base_url=url) as client:
        return split_testing.stream_until_signal(client, body, pid, sig)


def cpu_seconds_over(pid: int, seconds: float) -> float:
    """CPU time ``pid`` used in the next ``seconds``."""

    def used() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    before = used()
    time.sleep(seconds)
    return used() - before


def status(url: str) -> dict:
    return httpx.get(url + "/api/status", timeout=10).json()


def node_id(home: Path) -> str:
    return run_mesh("id", "--home", str(home)).stdout.strip().splitlines()[-1]


def invite(home: Path) -> str:
    made = run_mesh("invite", "--home", str(home), "--ttl", "10m")
    assert made.returncode == 0, made.stderr
    return made.stdout.strip().splitlines()[-1]


def unsplit_answer(model: Path) -> str:
    with run_worker_in_thread(model) as (base, _):
        answer = chat(base.removesuffix("/v1"))
    assert answer
    return answer


@pytest.mark.timeout(600)
def test_a_model_split_over_two_nodes_serves_fails_fast_and_reforms(tmp_path: Path) -> None:
    model = make_tiny_model(model_path(tmp_path / "a", "tiny6"), num_layers=6)
    expected = unsplit_answer(model)
    b = Running(tmp_path / "b", "--no-worker", "--share-memory", "1")
    a = None
    try:
        b_id = node_id(b.home)
        a = Running(
            tmp_path / "a", "--model", "tiny6", "--join", invite(b.home), "--split-over", b_id[:12]
        )
        assert wait_for(lambda: chat(a.url), 120, "the split model on A") == expected
        assert responses_text(a.url) == expected
        assert messages_text(a.url) == expected
        assert wait_for(lambda: chat(b.url), 30, "a forwarded route through B") == expected

        # Idle, B's rank dozes on its stdin instead of spinning in the ring (MLX's ring polls:
        # a whole core), and the next request wakes it through its order stream.
        (rank,) = rank_pids(tmp_path)
        assert wait_for(lambda: cpu_seconds_over(rank, 1.0) < 0.2, 30, "B's rank to doze")
        assert chat(a.url) == expected

        # The plan: rank 0 (the last layers) on A, rank 1 (the first ones) on B, which copied
        # only what it needs into its run directory, not its store.
        a_status = status(a.url)
        stages = a_status["node"]["split"]["groups"]["tiny6"]
        assert [(s["rank"], s["node_id"]) for s in stages] == [(1, b_id), (0, node_id(a.home))]
        assert [s["rank"] for s in status(b.url)["node"]["split"]["ranks"]] == [1]
        assert not model_path(b.home, "tiny6").exists()
        ad = next(m for m in status(b.url)["peers"][0]["models"] if m["name"] == "tiny6")
        assert len(ad["stages"]) == 2

        # Strangers get nothing from B's bridge: the TLS handshake refuses them.
        port = status(b.url)["node"]["bridge_port"]
        assert stranger_is_refused(port)

        for sig in (signal.SIGKILL, signal.SIGSTOP):
            (rank,) = wait_for(lambda: rank_pids(tmp_path), 60, "B's rank")
            last, took = stream_until_signal(a.url, rank, sig)
            assert '"error"' in last and took < 5.0, (sig, last, took)
            assert wait_for(lambda: served_or_503(a.url), 120, "the re-formed group") == expected

        # B's node gone: A cannot plan without it (--split-over names it), so the model waits
        # for memory – listed, 503 with Retry-After; B back (same home) re-forms the group.
        outage = Outage(a.url)
        outage.start()
        b.kill()
        wait_for(lambda: "tiny6" in status(a.url)["node"]["split"]["waiting"], 60, "waiting")
        assert served_or_503(a.url) is None
        assert status(a.url)["workers"]["tiny6"]["state"] in ("restarting", "starting")
        b = Running(tmp_path / "b", "--no-worker", "--share-memory", "1")
        assert wait_for(lambda: served_or_503(a.url), 120, "the group back with B") == expected
        outage.finish()
        assert status(a.url)["workers"]["tiny6"]["state"] == "serving"
    finally:
        out_a = a.stop() if a is not None else ""
        print("---- node A ----\n" + out_a)
        print("---- node B ----\n" + b.stop())
    assert "tiny6: 6 layers" in out_a and "pipeline over 2 ranks" in out_a
    assert wait_for(lambda: not rank_pids(tmp_path), 10, "ranks to stop")


def stranger_is_refused(port: int) -> bool:
    """A node that is no member (its own certificate, trusting anything) gets no byte."""
    context = make_context(NodeIdentity.generate(), [], server=False)
    context.verify_mode = ssl.CERT_NONE  # it would talk to anyone: only the server may refuse
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            with context.wrap_socket(raw, server_hostname=None) as tls:
                tls.sendall(b"ring x 1\n")
                return tls.recv(1) == b""
    except (ssl.SSLError, ConnectionError):
        return True


@pytest.mark.timeout(600)
def test_a_model_too_big_for_its_node_is_split_three_ways_over_the_offers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No split flag: A (pretending to have 6 MB) cannot hold the 7 MB model whole, B and C
    offer 3 MB each, so the plan takes all three nodes; B's and C's ranks reach each other
    through their own bridges, not through A."""
    model = make_tiny_model(model_path(tmp_path / "a", "tiny6"), num_layers=6)
    expected = unsplit_answer(model)
    b = Running(tmp_path / "b", "--no-worker", "--share-memory", "0.003")
    nodes = [b]
    try:
        c = Running(
            tmp_path / "c", "--no-worker", "--share-memory", "0.003", "--join", invite(b.home)
        )
        nodes.append(c)
        wait_for(lambda: len(status(c.url)["peers"]) == 1, 30, "C linked with B")
        monkeypatch.setenv("MLX_MESH_MEMORY_BYTES", "6e6")
        a = Running(tmp_path / "a", "--model", "tiny6", "--join", invite(b.home))
        monkeypatch.delenv("MLX_MESH_MEMORY_BYTES")
        nodes.append(a)
        assert wait_for(lambda: chat(a.url), 120, "the model split three ways") == expected
        assert wait_for(lambda: chat(c.url), 30, "a forwarded route through C") == expected
        stages = status(a.url)["node"]["split"]["groups"]["tiny6"]
        ids = {node_id(n.home) for n in nodes}
        assert {s["node_id"] for s in stages} == ids
        assert len(rank_pids(tmp_path)) == 2
    finally:
        outs = [n.stop() for n in reversed(nodes)]
        for out in outs:
            print("---- node ----\n" + out)
    assert "pipeline over 3 ranks" in outs[0]
