"""The ring bridge on loopback: a member's link reaches a registered rank port over pinned TLS;
strangers, plain TCP and unregistered ranks get nothing but a closed connection."""

from __future__ import annotations

import asyncio
import ssl

import pytest
from mesh_services import echo_rank

from mesh.copy.tls import cert_der, make_context
from mesh.identity import NodeIdentity
from mesh.loopback_ports import free_ports
from mesh.split import bridge
from mesh.split.bridge import BridgeLink, BridgeServer


async def closed_without_data(reader: asyncio.StreamReader) -> bool:
    try:
        async with asyncio.timeout(10):
            return await reader.read(1) == b""
    except (ConnectionError, ssl.SSLError):
        return True


async def link_closes_without_data(link: BridgeLink) -> bool:
    """Start ``link``, send a few bytes into it, and say whether it hung up without answering."""
    local = await link.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", local)
        writer.write(b"hello")
        return await closed_without_data(reader)
    finally:
        await link.close()


@pytest.fixture
async def nodes():
    a, b = NodeIdentity.generate(), NodeIdentity.generate()
    server = BridgeServer(b, trusted=lambda: [cert_der(a)])
    port = await server.start("127.0.0.1")
    rank, rank_port = await echo_rank()
    server.register("g1", 1, rank_port)
    yield a, b, server, port
    await server.close()
    rank.close()


async def test_a_members_link_carries_bytes_both_ways(nodes) -> None:
    a, b, _, port = nodes
    link = BridgeLink(a, ("127.0.0.1", port), cert_der(b), b.node_id, "g1", 1)
    local = await link.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", local)
        payload = bytes(range(256)) * 1000  # larger than one read
        writer.write(payload)
        await writer.drain()
        async with asyncio.timeout(10):
            assert await reader.readexactly(len(payload)) == payload
        writer.close()
    finally:
        await link.close()


@pytest.mark.parametrize("who", ["stranger", "wrong-rank", "plain-tcp"])
async def test_others_get_nothing(nodes, who: str, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, _, port = nodes
    if who == "plain-tcp":
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"ring g1 1\n")
        assert await closed_without_data(reader)
        return
    identity = NodeIdentity.generate() if who == "stranger" else a
    if who == "stranger":
        # Not a member: the server's handshake refuses its certificate.
        ctx = make_context(identity, [cert_der(b)], server=False)
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=ctx, server_hostname=""
            )
        except (ssl.SSLError, ConnectionError):
            return
        writer.write(b"ring g1 1\n")
        assert await closed_without_data(reader)
        return
    monkeypatch.setattr(bridge, "ROUTE_WAIT_S", 0.3)  # a rank never registered
    link = BridgeLink(a, ("127.0.0.1", port), cert_der(b), b.node_id, "g1", 7)
    assert await link_closes_without_data(link)


async def test_a_link_refuses_a_bridge_with_another_certificate(nodes) -> None:
    a, _, _, port = nodes
    impostor = NodeIdentity.generate()  # the link pins this one; the server presents b's
    link = BridgeLink(a, ("127.0.0.1", port), cert_der(impostor), impostor.node_id, "g1", 1)
    assert await link_closes_without_data(link)


async def test_a_rank_that_listens_late_is_waited_for(nodes) -> None:
    """A forming group dials its peers before they all listen; through the bridge the dial
    already succeeded, so the bridge waits for the rank's port instead of hanging up."""
    a, b, server, port = nodes
    (late_port,) = free_ports(1)
    server.register("g2", 1, late_port)
    link = BridgeLink(a, ("127.0.0.1", port), cert_der(b), b.node_id, "g2", 1)
    local = await link.start()
    late = None
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", local)
        writer.write(b"early bytes")
        await asyncio.sleep(0.5)
        late = await echo_rank(late_port)
        async with asyncio.timeout(10):
            assert await reader.readexactly(11) == b"early bytes"
        writer.close()
    finally:
        await link.close()
        if late is not None:
            late[0].close()


async def test_closing_a_link_mid_pipe_logs_one_line_not_a_traceback(nodes, caplog) -> None:
    """A link and the server closed while bytes flow end their connections as expected ends:
    no asyncio "Exception in callback" traceback, only the bridge's own lines."""
    a, b, server, port = nodes
    link = BridgeLink(a, ("127.0.0.1", port), cert_der(b), b.node_id, "g1", 1)
    local = await link.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", local)
    writer.write(b"ping")
    async with asyncio.timeout(10):
        assert await reader.readexactly(4) == b"ping"  # piping on both nodes now
    with caplog.at_level("DEBUG"):
        await link.close()
        await server.close()
        await asyncio.sleep(0.05)  # the stream protocol's done-callbacks run
    writer.close()
    tracebacks = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert tracebacks == []
    assert not [r for r in caplog.records if r.levelno >= 40]


@pytest.mark.parametrize("how", ["removed-then-registered", "dropped-while-waiting"])
async def test_a_member_removed_while_it_waits_for_its_rank_gets_nothing(how: str) -> None:
    """A link may wait (up to ROUTE_WAIT_S) for its rank to be registered. A member removed
    meanwhile must not be connected once the rank appears, and ``drop_member`` ends its
    waiting connection at once, as it does a piping one."""
    a, b = NodeIdentity.generate(), NodeIdentity.generate()
    members = [cert_der(a)]
    server = BridgeServer(b, trusted=lambda: list(members))
    port = await server.start("127.0.0.1")
    rank, rank_port = await echo_rank()
    link = BridgeLink(a, ("127.0.0.1", port), cert_der(b), b.node_id, "g3", 1)
    local = await link.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", local)
        writer.write(b"bytes for the ring")
        await asyncio.sleep(0.5)  # through TLS, now waiting for ("g3", 1)
        members.clear()  # removed from the mesh
        if how == "dropped-while-waiting":
            assert server.drop_member(a.node_id) == 1
        else:
            server.register("g3", 1, rank_port)
        assert await closed_without_data(reader)
    finally:
        await link.close()
        await server.close()
        rank.close()
