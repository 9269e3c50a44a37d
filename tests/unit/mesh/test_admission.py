"""The admission adapter over a scripted control stream: what it saves, and when."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from mesh.admission import Admission
from mesh.identity import NodeIdentity
from mesh.membership.handshake import ClientHandshake, Welcome, message_from_dict
from mesh.membership.members import MeshCredentials, load_members
from mesh.roster import Roster
from mesh.tunnel.frames import Control


class ScriptedControl:
    """The server's control stream, with a client handshake on its other end."""

    def __init__(self, client: ClientHandshake, on_welcome) -> None:
        self.client = client
        self.on_welcome = on_welcome
        self.inbox: asyncio.Queue[Control] = asyncio.Queue()
        self.inbox.put_nowait(Control(kind="auth", body=client.start().model_dump()))

    async def send(self, frame: Control) -> None:
        message = message_from_dict(frame.body)
        if isinstance(message, Welcome):
            self.on_welcome()
        for reply in self.client.receive(message):
            self.inbox.put_nowait(Control(kind="auth", body=reply.model_dump()))

    async def recv(self) -> Control:
        return await self.inbox.get()


async def test_the_inviter_saves_the_newcomer_before_it_sends_the_welcome(tmp_path: Path):
    home = tmp_path / "a"
    inviter, joiner = NodeIdentity.load_or_create(home), NodeIdentity.generate()
    credentials = MeshCredentials.create()
    roster = Roster(home, inviter)
    roster.settle_credentials(credentials, None)  # a member of its own new mesh
    roster.remember_self(["127.0.0.1:1"])
    token = roster.create_invite(credentials.mesh_id, ["127.0.0.1:1"], 60)
    admission = Admission(inviter, home, roster.members, credentials)
    client = ClientHandshake(
        me=joiner, mesh_id=credentials.mesh_id, expected_peer=inviter.node_id, invite=token
    )
    on_disk_at_welcome: list[set[str]] = []
    control = ScriptedControl(
        client, lambda: on_disk_at_welcome.append(set(load_members(home).members))
    )
    conn = SimpleNamespace(control=control, peer_cert_fingerprint=None, peer_node_id=None)
    assert await admission.admit(conn) == ""  # type: ignore[arg-type]
    assert on_disk_at_welcome == [{inviter.node_id, joiner.node_id}]
    # The invite is used on disk too: a crash after the Welcome cannot make it usable again.
    assert [r.used_by for r in load_members(home).invites.values()] == [joiner.node_id]
    # And the joiner's admission, signed by the inviter, is what makes it a member there.
    assert load_members(home).key_of(joiner.node_id) == joiner.public_key_bytes.hex()
