"""Peer copy inside real MeshServices (QUIC links on loopback, in-process): gossip says who
holds what, the links pin the certificates, the admin route streams the copy's progress."""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
from pathlib import Path

import httpx
import orjson
import pytest
from mesh_services import echo_rank, quick_mesh_config
from starlette.applications import Starlette

from gateway.upstream import StaticDirectory
from mesh.copy.client import CopyOptions
from mesh.copy.protocol import ManifestRequest, pack
from mesh.copy.server import CopyConfig
from mesh.copy.tls import cert_der, make_context
from mesh.errors import CopyError
from mesh.http import CSRF_HEADER, mesh_routes
from mesh.identity import NodeIdentity
from mesh.service import MeshConfig, MeshService
from mesh.split.bridge import BridgeLink
from worker.store import list_models, model_path
from worker.testing import wait_until


def _config(**kw) -> MeshConfig:
    return quick_mesh_config(**({"copy": CopyConfig(port=0, chunk_size=256 * 1024)} | kw))


@pytest.fixture
async def mesh(tmp_path):
    started: list[MeshService] = []

    async def start(name: str, **kw) -> MeshService:
        home = tmp_path / name
        node = MeshService(
            home, NodeIdentity.load_or_create(home), StaticDirectory(), _config(**kw)
        )
        await node.start()
        started.append(node)
        return node

    yield start
    for node in reversed(started):
        await node.stop()


async def _trio(mesh, tiny_model_dir: Path):
    a = await mesh("a")
    shutil.copytree(tiny_model_dir, model_path(a.home, "tiny"))
    b = await mesh("b", join_token=a.create_invite(60).encode())
    c = await mesh("c", join_token=a.create_invite(60).encode())
    shutil.copytree(tiny_model_dir, model_path(c.home, "tiny"))
    await wait_until(lambda: len(b.copy.sources("tiny")) == 2, limit_s=20)
    return a, b, c


async def test_two_holders_gossip_and_a_third_copies_from_both(mesh, tiny_model_dir):
    a, b, c = await _trio(mesh, tiny_model_dir)
    assert set(b.copy.holders()["tiny"]) == {a.node_id, c.node_id}
    # Tiny chunks so both sources carry some of the (small) model.
    a.copy.server.config.chunk_size = c.copy.server.config.chunk_size = 64 * 1024
    path = await b.copy.pull("tiny", options=CopyOptions(connections_per_source=2))
    assert path == model_path(b.home, "tiny")
    assert [m.name for m in list_models(b.home)] == ["tiny"]
    await wait_until(lambda: "tiny" in b.local_state().stored, limit_s=20)
    assert a.copy.server.bytes_served > 0 and c.copy.server.bytes_served > 0


async def test_from_forces_one_member(mesh, tiny_model_dir):
    a, b, c = await _trio(mesh, tiny_model_dir)
    await b.copy.pull("tiny", only=c.node_id[:10])
    assert c.copy.server.bytes_served > 0 and a.copy.server.bytes_served == 0
    with pytest.raises(CopyError, match="no linked member 'ffff'"):
        b.copy.sources("tiny", "ffff")


async def test_a_removed_member_can_no_longer_copy(mesh, tiny_model_dir):
    a = await mesh("a")
    shutil.copytree(tiny_model_dir, model_path(a.home, "tiny"))
    b = await mesh("b", join_token=a.create_invite(60).encode())
    await wait_until(lambda: b.copy.sources("tiny"), limit_s=20)
    sources = b.copy.sources("tiny")
    a.remove_member(b.node_id)
    await wait_until(lambda: b.node_id not in a.copy.trusted(), limit_s=20)
    from mesh.copy.client import fetch_model

    with pytest.raises(CopyError, match="could be reached"):
        await fetch_model(b.home, b.identity, "tiny", sources)
    # The server counts the refusal on its handler thread, which may finish after the client
    # already saw the connection closed.
    await wait_until(lambda: a.copy.server.refusals["not a member"] >= 1, limit_s=10)
    assert list_models(b.home) == []


def _app(node: MeshService) -> Starlette:
    return Starlette(routes=mesh_routes(node, api_key=None, csrf_token="t" * 24))


async def test_admin_route_streams_progress_then_done(mesh, tiny_model_dir):
    a, b, c = await _trio(mesh, tiny_model_dir)
    transport = httpx.ASGITransport(app=_app(b))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        listed = (await http.get("/api/mesh/models")).json()
        assert set(listed["holders"]["tiny"]) == {a.node_id, c.node_id}
        headers = {CSRF_HEADER: "t" * 24}
        missing = await http.post("/api/mesh/models/pull", json={"name": "nope"}, headers=headers)
        assert missing.status_code == 404
        refused = await http.post("/api/mesh/models/pull", json={"name": "tiny"})
        assert refused.status_code == 403  # no CSRF token
        response = await http.post("/api/mesh/models/pull", json={"name": "tiny"}, headers=headers)
    events = [orjson.loads(line) for line in response.text.splitlines()]
    assert events[-1] == {"type": "done", "name": "tiny", "path": str(model_path(b.home, "tiny"))}
    progress = [e for e in events if e["type"] == "progress"]
    assert progress and progress[-1]["done"] == progress[-1]["total"] > 0


async def test_pull_route_through_the_gateway_needs_the_key_and_the_console_origin(
    mesh, tiny_model_dir
):
    """What the console calls, behind the gateway's guards: off loopback only with the API
    key, never from another site's page; with both, the copy streams to its end."""
    from gateway.app import create_app
    from gateway.config import GatewayConfig

    a = await mesh("a")
    shutil.copytree(tiny_model_dir, model_path(a.home, "tiny"))
    b = await mesh("b", join_token=a.create_invite(60).encode())
    await wait_until(lambda: b.copy.sources("tiny"), limit_s=20)
    key = "k" * 24
    app = create_app(
        StaticDirectory(), GatewayConfig(api_key=key), extra_routes=mesh_routes(b, api_key=key)
    )
    transport = httpx.ASGITransport(app=app, client=("10.0.0.5", 1234))
    auth = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:9337") as http:
        body = {"name": "tiny"}
        assert (await http.get("/api/mesh/models")).status_code == 401
        assert (await http.post("/api/mesh/models/pull", json=body)).status_code == 401
        foreign = auth | {"origin": "http://evil.example"}
        refused = await http.post("/api/mesh/models/pull", json=body, headers=foreign)
        assert refused.status_code == 403
        assert list_models(b.home) == []
        own = auth | {"origin": "http://127.0.0.1:9337"}  # the console's own page
        response = await http.post("/api/mesh/models/pull", json=body, headers=own)
    assert response.status_code == 200
    assert orjson.loads(response.text.splitlines()[-1])["type"] == "done"
    assert [m.name for m in list_models(b.home)] == ["tiny"]


def _open_copy_connection(b: MeshService, a: MeshService) -> ssl.SSLSocket:
    """B's own copy connection to A, served once (a manifest), then held open."""
    context = make_context(b.identity, [cert_der(a.identity)], server=False)
    raw = socket.create_connection(("127.0.0.1", a.copy.port), timeout=10)
    tls = context.wrap_socket(raw)
    tls.sendall(pack(ManifestRequest(name="tiny")))
    assert tls.recv(1)  # served: A's reply starts
    return tls


def _ends_within(tls: ssl.SSLSocket, seconds: float) -> bool:
    """Whether A ends the connection within ``seconds`` (reading what it still had sent)."""
    tls.settimeout(seconds)
    try:
        while tls.recv(1 << 16):
            pass
    except TimeoutError:
        return False
    except (OSError, ssl.SSLError):
        pass
    return True


async def test_removal_closes_every_connection_the_member_held_open(mesh, tiny_model_dir):
    """Tunnel, peer copy and ring bridge connections B opened before its removal all end at
    once on A (the audit saw a copy connection serve a whole model 52 s after removal)."""
    a = await mesh("a", bridge=True)
    shutil.copytree(tiny_model_dir, model_path(a.home, "tiny"))
    b = await mesh("b", join_token=a.create_invite(60).encode())
    await wait_until(lambda: b.node_id in a.links and a.node_id in b.links, limit_s=20)
    copy = await asyncio.to_thread(_open_copy_connection, b, a)
    rank, rank_port = await echo_rank()
    a.split.bridge.register("g1", 1, rank_port)
    link = BridgeLink(
        b.identity, ("127.0.0.1", a.split.port), cert_der(a.identity), a.node_id, "g1", 1
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", await link.start())
    writer.write(b"ping")
    async with asyncio.timeout(10):
        assert await reader.readexactly(4) == b"ping"  # piping through A's bridge
    try:
        a.remove_member(b.node_id)
        await wait_until(lambda: b.node_id not in a.links, limit_s=5)
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # the bridge connection ended
        assert await asyncio.to_thread(_ends_within, copy, 5.0)  # and the copy connection
    finally:
        copy.close()
        writer.close()
        await link.close()
        rank.close()
