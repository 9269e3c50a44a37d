"""The fault lab's plumbing without a mesh: chaos-proxy links between UDP endpoints on loopback,
and process groups that are always cleaned up (close, exceptions, SIGTERM, stopped processes)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lab.links import LinkFabric, chaos_fields, namespace_support
from lab.nodes import rewrite_invite
from lab.procs import ProcessRegistry, alive, descendants
from lab.scenario import FaultSettings, partition_directions
from mesh.membership.invite import decode_invite, make_invite


class Echo(asyncio.DatagramProtocol):
    """A stand-in for a node's mesh port: answers every datagram with b"echo:" + it."""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        self.transport.sendto(b"echo:" + data, addr)


class Client(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.received: asyncio.Queue[bytes] = asyncio.Queue()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        self.received.put_nowait(data)


async def _roundtrip(
    client: Client, address: str, payload: bytes, wait_s: float = 0.3
) -> bytes | None:
    host, port = address.rsplit(":", 1)
    client.transport.sendto(payload, (host, int(port)))
    try:
        return await asyncio.wait_for(client.received.get(), wait_s)
    except TimeoutError:
        return None


async def test_fabric_routes_each_pair_through_its_own_proxy_and_faults_follow_direction() -> None:
    loop = asyncio.get_running_loop()
    echoes = [
        await loop.create_datagram_endpoint(Echo, local_addr=("127.0.0.1", 0)) for _ in range(3)
    ]
    ports = [t.get_extra_info("sockname")[1] for t, _ in echoes]
    fabric = LinkFabric(ports, seed=3)
    transport, client = await loop.create_datagram_endpoint(Client, local_addr=("127.0.0.1", 0))
    try:
        await fabric.start()
        assert len(fabric.proxies) == 6
        assert fabric.peers_of(0) == [fabric.address(0, 1), fabric.address(0, 2)]
        assert await _roundtrip(client, fabric.address(0, 1), b"a") == b"echo:a"

        fabric.set_link("0->1", FaultSettings(blackhole=True))  # one way: 0's datagrams to 1
        assert await _roundtrip(client, fabric.address(0, 1), b"b") is None
        assert (
            fabric.proxies[(0, 1)].upstream.blackhole
            and not fabric.proxies[(0, 1)].downstream.blackhole
        )
        assert fabric.proxies[(1, 0)].downstream.blackhole  # replies on 1's own connection to 0
        assert await _roundtrip(client, fabric.address(0, 2), b"c") == b"echo:c"

        fabric.clear("0->1")
        assert fabric.faults == {}
        assert await _roundtrip(client, fabric.address(0, 1), b"d") == b"echo:d"

        fabric.partition([[0], [1, 2]])
        assert set(fabric.faults) == {(0, 1), (0, 2), (1, 0), (2, 0)}
        assert await _roundtrip(client, fabric.address(0, 2), b"e") is None
        assert await _roundtrip(client, fabric.address(1, 2), b"f") == b"echo:f"
        fabric.clear()
        assert await _roundtrip(client, fabric.address(0, 2), b"g") == b"echo:g"
        stats = fabric.stats()
        assert stats["0->2"]["upstream"]["dropped"] == 1
    finally:
        transport.close()
        await fabric.close()
        for t, _ in echoes:
            t.close()


def test_fault_fields_and_partition_directions() -> None:
    fields = chaos_fields(FaultSettings(loss=0.3, delay_ms=20, jitter_ms=5, bandwidth_kbps=800))
    assert fields == {
        "loss": 0.3,
        "delay_ms": 20,
        "jitter_ms": 5,
        "duplicate": 0.0,
        "blackhole": False,
        "bandwidth": 100_000,
    }
    assert chaos_fields(FaultSettings())["bandwidth"] is None
    assert sorted(partition_directions([[0], [1, 2]])) == [(0, 1), (0, 2), (1, 0), (2, 0)]
    ok, why = namespace_support()
    assert isinstance(ok, bool) and why


def test_rewritten_invite_dials_the_proxy_and_keeps_the_pin() -> None:
    token = make_invite(
        mesh_id="m",
        inviter="n" * 64,
        fingerprint="f" * 64,
        addresses=["10.0.0.1:9338"],
        now=0,
        ttl_s=10,
    )
    rewritten = decode_invite(rewrite_invite(token.encode(), "127.0.0.1:4000"))
    assert rewritten.addresses == ["127.0.0.1:4000"]
    assert rewritten.model_dump(exclude={"addresses"}) == token.model_dump(exclude={"addresses"})


TREE = [
    sys.executable,
    "-c",
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)",
]


def _wait_for_child(pid: int) -> list[int]:
    for _ in range(200):
        found = descendants(pid)
        if found:
            return found
        time.sleep(0.02)
    raise AssertionError("child never appeared")


def test_registry_ends_whole_trees_even_stopped_ones(tmp_path: Path) -> None:
    registry = ProcessRegistry()
    first = registry.spawn("a", TREE, log_path=tmp_path / "a.log")
    second = registry.spawn("b", TREE, log_path=tmp_path / "b.log")
    children = _wait_for_child(first.pid) + _wait_for_child(second.pid)
    assert os.getpgid(first.pid) == first.pid  # its own group: signals reach the whole tree
    second.signal_tree(signal.SIGSTOP)  # a frozen node must still be cleaned up
    registry.close(grace_s=2)
    assert registry.leftovers() == []
    assert not any(alive(p) for p in [first.pid, second.pid, *children])
    registry.close()  # idempotent


def test_sigkill_of_a_node_takes_its_worker_along(tmp_path: Path) -> None:
    registry = ProcessRegistry()
    node = registry.spawn("node", TREE, log_path=tmp_path / "n.log")
    (child,) = _wait_for_child(node.pid)
    node.signal_tree(signal.SIGKILL)
    node.popen.wait(5)
    for _ in range(100):
        if not alive(child):
            break
        time.sleep(0.02)
    assert not alive(child)
    registry.close()


@pytest.mark.parametrize("ending", ["exception", "sigterm"])
def test_cleanup_runs_when_the_lab_process_dies(tmp_path: Path, ending: str) -> None:
    """A lab that raises, or is sent SIGTERM, still ends every process it started (atexit)."""
    pid_file = tmp_path / "pids"
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from lab.procs import ProcessRegistry, descendants
        registry = ProcessRegistry()
        registry.install_cleanup()
        node = registry.spawn("node", {TREE!r}, log_path=Path({str(tmp_path / "n.log")!r}))
        while not descendants(node.pid):
            time.sleep(0.02)
        registry.note_descendants()
        Path({str(pid_file)!r}).write_text(" ".join(map(str, [node.pid, *descendants(node.pid)])))
        if {ending!r} == "exception":
            raise RuntimeError("the lab crashed")
        time.sleep(60)
        """
    )
    lab = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parents[2],
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(500):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.02)
        pids = [int(p) for p in pid_file.read_text().split()]
        if ending == "sigterm":
            lab.send_signal(signal.SIGTERM)
        lab.wait(20)
    finally:
        if lab.poll() is None:
            lab.kill()
    assert lab.returncode != 0
    assert not any(alive(p) for p in pids), pids


def test_mesh_up_command_for_a_lab_node(tmp_path: Path) -> None:
    from lab.nodes import MESH_MAIN, NO_DIRECT_ADDRESS, LabNode
    from lab.scenario import NodeSpec

    model = tmp_path / "tiny-1"
    model.mkdir()
    node = LabNode(index=1, spec=NodeSpec(), home=tmp_path / "home", model_arg=str(model))
    assert node.model_id == "tiny-1" and node.url == f"http://127.0.0.1:{node.http_port}"
    flags = {"--host", "--mesh-host"}
    argv = node.up_argv(
        peers=["127.0.0.1:1", "127.0.0.1:2"], join_token="tok", flags=flags, extra=[]
    )
    assert argv[2] == MESH_MAIN
    joined = " ".join(argv[3:])
    assert f"up --home {tmp_path / 'home'} --model {model} --port {node.http_port}" in joined
    assert f"--mesh-port {node.mesh_port} --no-discovery" in joined
    assert "--peer 127.0.0.1:1 --peer 127.0.0.1:2 --join tok" in joined
    assert "--mesh-host 127.0.0.1" in joined and "--host 127.0.0.1" in joined
    assert f"--advertise {NO_DIRECT_ADDRESS}" in joined  # peers can dial it only via proxies
    gateway_only = LabNode(index=0, spec=NodeSpec(model="none"), home=tmp_path, model_arg="")
    assert "--no-worker" in gateway_only.up_argv(peers=[], join_token=None, flags=set(), extra=[])
