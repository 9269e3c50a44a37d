"""Membership between in-process nodes over real QUIC: what a removal does, and what the
status shows of the nodes turned away."""

from __future__ import annotations

import pytest
from mesh_services import MeshNodes

from gateway.testing import ScriptedUpstream, text_script
from worker.testing import wait_until


@pytest.fixture
async def nodes(tmp_path):
    nodes = MeshNodes(tmp_path, down_after_s=2.0, drop_after_s=10.0)
    yield nodes
    await nodes.stop_all()


async def test_a_removed_node_that_keeps_dialing_shows_in_the_refusals(nodes) -> None:
    a = await nodes.start("a", {"tiny": ScriptedUpstream.of(*text_script("x"))})
    c = await nodes.start("c", join_token=a.create_invite(60).encode())
    await wait_until(lambda: c.node_id in a.links, limit_s=15)
    assert a.status()["node"]["refused"] == {}
    a.remove_member(c.node_id)
    # C still holds its old files and redials A: each try is refused, and counted by reason.
    await wait_until(lambda: a.status()["node"]["refused"].get("removed", 0) >= 1, limit_s=15)
    assert c.node_id not in a.links
