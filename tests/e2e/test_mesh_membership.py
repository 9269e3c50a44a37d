"""Membership between in-process nodes over real QUIC: the audit's attacks replayed (issue 44),
what a removal does, the mesh secret's rotation, and what the status shows of the nodes turned
away. The replays use only what today's wire had (a ``members`` gossip frame as a dict), so
they can be run against the code before signed membership too: there, they fail."""

from __future__ import annotations

import asyncio
import shutil
import socket
import time
from pathlib import Path

import orjson
import pytest
from mesh_services import MeshNodes

from gateway.events import TextDelta
from gateway.request import ChatRequest, Message
from gateway.router import RouteError, Router
from gateway.testing import ScriptedUpstream, text_script
from mesh.errors import MeshError
from mesh.identity import NodeIdentity
from mesh.loopback_ports import free_ports
from mesh.service import MeshService
from mesh.tunnel.frames import Control
from worker.testing import wait_until


@pytest.fixture
async def nodes(tmp_path):
    nodes = MeshNodes(tmp_path, down_after_s=2.0, drop_after_s=10.0)
    yield nodes
    await nodes.stop_all()


async def _mesh_of_three(nodes: MeshNodes) -> tuple[MeshService, MeshService, MeshService]:
    """A (serving "tiny"), B, and X, the member that turns hostile; all linked."""
    a = await nodes.start("a", {"tiny": ScriptedUpstream.of(*text_script("served"))})
    b = await nodes.start("b", join_token=a.create_invite(60).encode())
    x = await nodes.start("x", join_token=a.create_invite(60).encode())
    trio = (a, b, x)
    await wait_until(
        lambda: all(o.node_id in n.links for n in trio for o in trio if o is not n), limit_s=20
    )
    return a, b, x


async def _gossip(sender: MeshService, to: MeshService, body: dict) -> None:
    control = sender.links[to.node_id].control
    assert control is not None
    await control.send(Control(kind="gossip", body=body))


def _member_entry(identity: NodeIdentity, address: str) -> dict:
    return {
        "node_id": identity.node_id,
        "public_key": identity.public_key_bytes.hex(),
        "fingerprint": identity.cert_fingerprint,
        "addresses": [address],
        "updated_at": time.time(),
    }


def _members_on_disk(node: MeshService) -> set[str]:
    return set(orjson.loads((node.home / "members.json").read_bytes())["members"])


async def _served(node: MeshService, model: str) -> bool:
    """Whether ``node`` gets an answer for ``model`` (from wherever the mesh serves it)."""
    request = ChatRequest(model=model, messages=[Message(role="user", content="hi")])
    router = Router(node.directory, retry_backoff_s=0.05)
    try:
        routes = router.resolve(request)
    except RouteError:  # no node serves it to this one
        return False
    events = [e async for e in router.stream(request, routes)]
    return any(isinstance(e, TextDelta) for e in events)


async def test_a_planted_identity_is_not_stored_and_cannot_link_after_its_planter_is_removed(
    nodes, tmp_path: Path
) -> None:
    """The audit's repro: one ``members`` frame from linked member X lists a fresh identity P
    with an address; X is removed; P starts with X's mesh.json (and its members.json, for the
    addresses) and tries to link to the remaining members and be served. Before signed
    membership A and B stored P, and P linked to both within 5 s and was served."""
    a, b, x = await _mesh_of_three(nodes)
    await wait_until(lambda: "tiny" in b.peers.models(), limit_s=15)
    assert await _served(b, "tiny")  # what "served" means: a member gets A's answer
    p_home = tmp_path / "p"
    plant = NodeIdentity.load_or_create(p_home)
    (p_port,) = free_ports(1, socket.SOCK_DGRAM)  # where P will listen: the planted address
    entry = _member_entry(plant, f"127.0.0.1:{p_port}")
    frame = {"type": "members", "members": [entry], "removed": {}}
    await _gossip(x, a, frame)
    await _gossip(x, b, frame)
    await asyncio.sleep(1.0)
    # What happened, step by step (the whole replay runs, so a failure shows every step).
    seen = {"stored": bool({plant.node_id} & (_members_on_disk(a) | _members_on_disk(b)))}

    a.remove_member(x.node_id)
    await wait_until(lambda: x.node_id not in b.members.members, limit_s=15)
    await x.stop()
    for name in ("mesh.json", "members.json"):
        shutil.copy(x.home / name, p_home / name)
    p = await nodes.start("p", port=p_port)
    deadline = time.monotonic() + 8.0  # the audit saw it linked in 3.5–4.7 s
    while time.monotonic() < deadline and not seen.get("linked"):
        seen["linked"] = plant.node_id in a.links or plant.node_id in b.links
        await asyncio.sleep(0.2)
    seen["served"] = await _served(p, "tiny")
    assert seen == {"stored": False, "linked": False, "served": False}
    assert a.status()["node"]["refused"].get("not_a_member", 0) >= 1


async def test_an_unsigned_removal_in_gossip_evicts_nobody(nodes) -> None:
    """The audit: the same frame could carry ``removed`` tombstones, so any member could evict
    any other without a trace. Unsigned, they are ignored; a signed one names its remover."""
    a, b, x = await _mesh_of_three(nodes)
    await _gossip(x, a, {"type": "members", "members": [], "removed": {b.node_id: time.time()}})
    await asyncio.sleep(1.0)
    assert b.node_id in a.members.members and b.node_id in a.links

    # A member may still remove another (every member may), but it is signed and shown.
    x.remove_member(b.node_id)
    await wait_until(lambda: b.node_id not in a.members.members, limit_s=15)
    (row,) = a.removed_rows()
    assert row["node_id"] == b.node_id and row["removed_by"] == x.node_id


async def test_a_flood_of_fresh_keys_in_one_frame_is_refused_whole(nodes) -> None:
    """The audit: one frame with 800 random keys grew members.json to 804 members (349 KB)
    and set every dialer trying them all."""
    a, b, x = await _mesh_of_three(nodes)
    flood = [_member_entry(NodeIdentity.generate(), "127.0.0.1:9") for _ in range(800)]
    await _gossip(x, a, {"type": "members", "members": flood, "removed": {}})
    await asyncio.sleep(1.5)
    assert set(a.members.members) == {a.node_id, b.node_id, x.node_id}
    assert len(_members_on_disk(a)) == 3 and (a.home / "members.json").stat().st_size < 20_000
    assert a.status()["node"]["ignored"] == {"member fact refused: too_many_entries": 1}
    assert a.links.keys() == {b.node_id, x.node_id}  # and the link stays up


async def test_a_plant_signed_by_its_member_goes_with_it(nodes, tmp_path: Path) -> None:
    """What a hostile member CAN still do: admit a key of its own (signed, so shown as its
    doing). Removing the member takes that key out too, everywhere."""
    from mesh.membership.facts import sign_admission

    a, b, x = await _mesh_of_three(nodes)
    plant = NodeIdentity.load_or_create(tmp_path / "p")
    admission = sign_admission(
        x.identity, x.mesh_id, plant.node_id, plant.public_key_bytes.hex(), "", time.time()
    )
    body = {
        "type": "members",
        "members": [_member_entry(plant, "127.0.0.1:9")],
        "admissions": [admission.model_dump()],
    }
    await _gossip(x, a, body)
    await wait_until(lambda: plant.node_id in b.members.members, limit_s=15)  # passed on
    rows = {r["node_id"]: r for r in a.member_rows()}
    assert rows[plant.node_id]["admitted_by"] == x.node_id

    report = a.remove_member(x.node_id, dry_run=True)
    assert report.going_with == [plant.node_id] and x.node_id in a.members.members
    report = a.remove_member(x.node_id)
    assert report.going_with == [plant.node_id]
    for node in (a, b):
        await wait_until(lambda n=node: plant.node_id not in n.members.members, limit_s=15)
    shutil.copy(x.home / "mesh.json", tmp_path / "p" / "mesh.json")
    shutil.copy(x.home / "members.json", tmp_path / "p" / "members.json")
    await x.stop()
    p = await nodes.start("p")
    await asyncio.sleep(3.0)
    assert p.node_id not in a.links and p.node_id not in b.links


async def test_the_secret_rotates_on_removal_and_reaches_a_member_that_was_away(nodes) -> None:
    a, b, x = await _mesh_of_three(nodes)
    old = a.credentials
    assert old is not None and b.credentials == old == x.credentials
    await b.stop()  # away while X is removed
    a.remove_member(x.node_id)
    new = a.credentials
    assert new is not None and new.secret_generation == 1 and new.mesh_secret != old.mesh_secret
    assert x.credentials == old  # the removed member never gets it
    b = await nodes.start("b")  # back, with the old secret: it still links (its key is admitted)
    await wait_until(lambda: b.credentials == new, limit_s=15)
    assert b.node_id in a.links and x.node_id not in b.members.members
    stored = orjson.loads((b.home / "mesh.json").read_bytes())
    assert stored["secret_generation"] == 1 and stored["mesh_secret"] == new.mesh_secret
    with pytest.raises(MeshError):
        a.remove_member(a.node_id)


async def test_a_removed_node_that_keeps_dialing_shows_in_the_refusals(nodes) -> None:
    a = await nodes.start("a", {"tiny": ScriptedUpstream.of(*text_script("x"))})
    c = await nodes.start("c", join_token=a.create_invite(60).encode())
    await wait_until(lambda: c.node_id in a.links, limit_s=15)
    assert a.status()["node"]["refused"] == {}
    a.remove_member(c.node_id)
    await c.stop()
    # C restarts with its old files and dials A: each try is refused, and counted by reason.
    await nodes.start("c")
    await wait_until(lambda: a.status()["node"]["refused"].get("removed", 0) >= 1, limit_s=15)
    assert c.node_id not in a.links
