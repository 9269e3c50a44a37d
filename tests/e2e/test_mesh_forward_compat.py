"""A newer peer is not cut off: between two in-process nodes of today's code over real QUIC, a
control kind and a gossip type this version does not know, a known message with a malformed
value and a member entry whose key is not hex are each dropped and counted; the link stays up
and the next good message is used."""

from __future__ import annotations

import asyncio

import pytest
from mesh_services import MeshNodes

from gateway.testing import ScriptedUpstream, text_script
from mesh.tunnel.frames import Control
from worker.testing import wait_until


@pytest.fixture
async def nodes(tmp_path):
    nodes = MeshNodes(tmp_path, down_after_s=2.0, drop_after_s=10.0)
    yield nodes
    await nodes.stop_all()


async def test_messages_from_a_newer_peer_never_end_the_link(nodes) -> None:
    a = await nodes.start("a", {"tiny": ScriptedUpstream.of(*text_script("x"))})
    b = await nodes.start("b", join_token=a.create_invite(60).encode())
    await wait_until(lambda: b.node_id in a.links and "tiny" in b.peers.models(), limit_s=15)
    link = a.links[b.node_id]
    control = b.links[a.node_id].control
    assert control is not None
    future = [
        Control(kind="telemetry", body={"v": 2}),  # a control kind of a later version
        Control(kind="gossip", body={"type": "capabilities", "node_id": b.node_id}),
        # Known types with a malformed value: the message alone is dropped.
        Control(kind="gossip", body={"type": "state", "node_id": b.node_id, "cache": {"m": 7}}),
        Control(
            kind="gossip",
            body={"type": "members", "members": [{"node_id": "ab", "public_key": "not hex"}]},
        ),
    ]
    for frame in future:
        await control.send(frame)
    await asyncio.sleep(1.0)  # a link that was going to end would have ended by now
    assert a.links.get(b.node_id) is link and not link.is_closed
    assert a.status()["node"]["ignored"] == {
        "unknown control kind 'telemetry'": 1,
        "unknown gossip type 'capabilities'": 1,
        "bad gossip message: 1 errors": 1,
    }
    # Still a working link: B's next state arrives and A's model is still served through it.
    before = a.peers.peers[b.node_id].state.seq
    await wait_until(lambda: a.peers.peers[b.node_id].state.seq > before, limit_s=10)
