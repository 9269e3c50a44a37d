"""Invite tokens and the membership handshake, without any I/O: every refusal case."""

from __future__ import annotations

import copy
import os
import stat

import orjson
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hypothesis import given
from hypothesis import strategies as st

from mesh.errors import HandshakeInputError
from mesh.identity import node_id_of as node_id_for
from mesh.membership.facts import Root, signature_holds
from mesh.membership.handshake import (
    INVITE_RETRY_S,
    AuthFailure,
    Challenge,
    ClientHandshake,
    Denied,
    HandshakeState,
    Hello,
    Proof,
    ServerHandshake,
    Welcome,
    message_from_dict,
)
from mesh.membership.invite import (
    TOKEN_PREFIX,
    InviteError,
    decode_invite,
    make_invite,
    parse_ttl,
    secret_digest,
)
from mesh.membership.members import (
    Member,
    MemberStore,
    MeshCredentials,
    load_credentials,
    load_members,
    save_credentials,
    save_members,
)

NOW = 1_000_000.0


class KeySigner:
    """A Signer over a raw Ed25519 key (what mesh.identity provides in the node)."""

    def __init__(self) -> None:
        self._key = Ed25519PrivateKey.generate()
        self.public_key_bytes = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.node_id = node_id_for(self.public_key_bytes)

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def member(self, addresses: list[str] | None = None) -> Member:
        return Member(
            node_id=self.node_id,
            public_key=self.public_key_bytes.hex(),
            fingerprint="fp-" + self.node_id[:8],
            addresses=addresses or [],
        )


@pytest.fixture
def mesh() -> MeshCredentials:
    return MeshCredentials.create()


@pytest.fixture
def server_key() -> KeySigner:
    return KeySigner()


@pytest.fixture
def store(mesh: MeshCredentials, server_key: KeySigner) -> MemberStore:
    """The server's store: a mesh it created (its root), itself with its address."""
    store = MemberStore()
    store.open(mesh.mesh_id, Root.of(server_key))
    store.note_member(server_key.member(["127.0.0.1:9338"]))
    return store


def _admit(store: MemberStore, server_key: KeySigner, member: Member) -> None:
    """The server admits ``member`` (as its join would have)."""
    store.admit(server_key, member, "test", NOW)


def _invite(mesh: MeshCredentials, server_key: KeySigner, store: MemberStore, ttl: float = 60):
    token = make_invite(
        mesh_id=mesh.mesh_id,
        inviter=server_key.node_id,
        fingerprint="fp",
        addresses=["127.0.0.1:9338"],
        now=NOW,
        ttl_s=ttl,
    )
    store.remember_invite(token)
    return token


def _server(server_key, mesh, store, now=NOW) -> ServerHandshake:
    return ServerHandshake(me=server_key, credentials=mesh, store=store, now=now)


def _run(client: ClientHandshake, server: ServerHandshake) -> None:
    """Shuttle messages (through their wire encoding) until both sides are done."""
    outbox = [client.start()]
    to_server = True
    while outbox:
        side = server if to_server else client
        replies = []
        for message in outbox:
            # The wire path: model_dump -> the Control frame's JSON -> message_from_dict.
            replies += side.receive(
                message_from_dict(orjson.loads(orjson.dumps(message.model_dump())))
            )
        outbox = replies
        to_server = not to_server


# --------------------------------------------------------------------------- invites


def test_invite_roundtrip_and_prefix():
    token = make_invite(
        mesh_id="m", inviter="a" * 64, fingerprint="f", addresses=["1.2.3.4:9338"], now=NOW
    )
    text = token.encode()
    assert text.startswith(TOKEN_PREFIX)
    assert "=" not in text  # url-safe, no padding: one shell word
    assert decode_invite(text) == token
    assert not token.is_expired(NOW + 10)
    assert token.is_expired(NOW + 3600)


@pytest.mark.parametrize(
    "text", ["", "hello", "mlxmesh2.abc", "mlxmesh1.", "mlxmesh1.!!!", "mlxmesh1.e30"]
)
def test_invite_decode_rejects_garbage(text):
    with pytest.raises(InviteError):
        decode_invite(text)


@given(st.text(max_size=200))
def test_invite_decode_never_crashes(text):
    try:
        decode_invite(TOKEN_PREFIX + text)
    except InviteError:
        pass


def test_parse_ttl():
    assert parse_ttl("1h") == 3600
    assert parse_ttl("15m") == 900
    assert parse_ttl("90") == 90
    assert parse_ttl("30d") == 30 * 86400
    for bad in ["", "0", "-1h", "soon", "1e9d", "31d", "inf", "nan"]:
        with pytest.raises(InviteError):
            parse_ttl(bad)


# --------------------------------------------------------------------------- join


def test_join_succeeds_and_hands_out_mesh_secret(mesh, server_key, store):
    token = _invite(mesh, server_key, store)
    joiner = KeySigner()
    server = _server(server_key, mesh, store)
    client = ClientHandshake(
        me=joiner,
        mesh_id=token.mesh_id,
        expected_peer=token.inviter,
        invite=token,
        fingerprint="fp-joiner",
        addresses=["127.0.0.1:1"],
    )
    _run(client, server)
    assert server.state is client.state is HandshakeState.ACCEPTED
    assert client.welcome is not None and client.welcome.mesh_secret == mesh.mesh_secret
    ids = {m.node_id for m in client.welcome.members}
    assert ids == {server_key.node_id, joiner.node_id}
    assert client.peer is not None and client.peer.addresses == ["127.0.0.1:9338"]
    assert store.members[joiner.node_id].fingerprint == "fp-joiner"
    assert server.peer is not None and server.peer.node_id == joiner.node_id
    # The Welcome carries the signed facts: the root, and the joiner's admission by the
    # inviter, naming the invite it consumed.
    assert client.welcome.root == Root.of(server_key)
    (admission,) = client.welcome.admissions
    assert admission.node_id == joiner.node_id and admission.by == server_key.node_id
    assert admission.invite == secret_digest(token.secret)
    assert signature_holds(admission, mesh.mesh_id, server_key.public_key_bytes.hex())


def _join_failure(mesh, server_key, store, token, *, now=NOW, joiner=None) -> AuthFailure:
    server = _server(server_key, mesh, store, now=now)
    client = ClientHandshake(
        me=joiner or KeySigner(), mesh_id=token.mesh_id, expected_peer=token.inviter, invite=token
    )
    _run(client, server)
    assert server.state is HandshakeState.REFUSED
    assert client.state is HandshakeState.REFUSED and client.failure is AuthFailure.DENIED
    assert client.welcome is None
    return server.failure


def test_join_wrong_secret_refused(mesh, server_key, store):
    token = _invite(mesh, server_key, store)
    forged = token.model_copy(update={"secret": "guess"})
    assert _join_failure(mesh, server_key, store, forged) is AuthFailure.BAD_INVITE


def test_join_without_any_invite_refused(mesh, server_key, store):
    token = make_invite(mesh_id=mesh.mesh_id, inviter=server_key.node_id, fingerprint="f",
                        addresses=[], now=NOW)  # fmt: skip
    assert _join_failure(mesh, server_key, store, token) is AuthFailure.BAD_INVITE


def test_join_expired_token_refused(mesh, server_key, store):
    token = _invite(mesh, server_key, store, ttl=60)
    failure = _join_failure(mesh, server_key, store, token, now=NOW + 61)
    assert failure is AuthFailure.INVITE_EXPIRED


def test_join_reused_token_refused(mesh, server_key, store):
    token = _invite(mesh, server_key, store)
    first = KeySigner()
    server = _server(server_key, mesh, store)
    _run(ClientHandshake(me=first, mesh_id=mesh.mesh_id, expected_peer=None, invite=token), server)
    assert server.state is HandshakeState.ACCEPTED
    assert _join_failure(mesh, server_key, store, token) is AuthFailure.INVITE_USED
    assert len(store.members) == 2  # the second joiner was not added


def test_join_retry_by_same_joiner_is_not_reuse(mesh, server_key, store):
    """A joiner whose Welcome got lost may present its token again."""
    token = _invite(mesh, server_key, store)
    joiner = KeySigner()
    for _ in range(2):
        server = _server(server_key, mesh, store)
        client = ClientHandshake(me=joiner, mesh_id=mesh.mesh_id, expected_peer=None, invite=token)
        _run(client, server)
        assert client.state is HandshakeState.ACCEPTED


def test_an_invite_is_one_use_even_for_its_joiner_after_the_retry_window(
    mesh, server_key, store, tmp_path
):
    """Past the lost-Welcome window, the joiner's own token is a reuse too – also after the
    inviter restarted (the use is in members.json)."""
    token = _invite(mesh, server_key, store)
    joiner = KeySigner()
    server = _server(server_key, mesh, store)
    _run(ClientHandshake(me=joiner, mesh_id=mesh.mesh_id, expected_peer=None, invite=token), server)
    assert server.state is HandshakeState.ACCEPTED
    save_members(tmp_path, store)
    reloaded = load_members(tmp_path)
    later = NOW + INVITE_RETRY_S + 1
    failure = _join_failure(mesh, server_key, reloaded, token, now=later, joiner=joiner)
    assert failure is AuthFailure.INVITE_USED


def test_a_removed_node_is_refused_with_its_old_invite_a_fresh_one_or_the_secret(
    mesh, server_key, store, tmp_path
):
    """Removed B wiped mesh.json and members.json, kept its identity, and shows the invite it
    joined with: refused, within the retry window too; a fresh invite or the mesh secret
    (member mode) do no better, and all of it holds across the member's restart."""
    old = _invite(mesh, server_key, store)
    b = KeySigner()
    server = _server(server_key, mesh, store)
    _run(ClientHandshake(me=b, mesh_id=mesh.mesh_id, expected_peer=None, invite=old), server)
    assert server.state is HandshakeState.ACCEPTED
    assert store.remove(server_key, b.node_id, NOW + 1, []).left == [b.node_id]
    save_members(tmp_path, store)
    store = load_members(tmp_path)  # the member restarted
    assert _join_failure(mesh, server_key, store, old, now=NOW + 2, joiner=b) is AuthFailure.REMOVED
    fresh = _invite(mesh, server_key, store)
    assert _join_failure(mesh, server_key, store, fresh, joiner=b) is AuthFailure.REMOVED
    server = _server(server_key, mesh, store)
    client = _member_client(b, mesh, server_key.node_id)
    _run(client, server)
    assert server.failure is AuthFailure.REMOVED and b.node_id not in store.members
    assert store.invites[secret_digest(fresh.secret)].used_by is None  # not spent on it


def test_join_other_mesh_refused(mesh, server_key, store):
    token = _invite(mesh, server_key, store)
    other = token.model_copy(update={"mesh_id": "other"})
    assert _join_failure(mesh, server_key, store, other) is AuthFailure.WRONG_MESH


# --------------------------------------------------------------------------- members


def _member_client(me, mesh, expected_peer) -> ClientHandshake:
    return ClientHandshake(me=me, mesh_id=mesh.mesh_id, expected_peer=expected_peer,
                           credentials=mesh)  # fmt: skip


def test_member_rejoins_without_token(mesh, server_key, store):
    member = KeySigner()
    _admit(store, server_key, member.member(["127.0.0.1:2"]))
    server = _server(server_key, mesh, store)
    client = _member_client(member, mesh, server_key.node_id)
    _run(client, server)
    assert client.state is server.state is HandshakeState.ACCEPTED
    assert client.welcome is not None and client.welcome.mesh_secret is None  # not re-sent


def test_member_unknown_key_refused(mesh, server_key, store):
    stranger = KeySigner()
    server = _server(server_key, mesh, store)
    _run(_member_client(stranger, mesh, server_key.node_id), server)
    assert server.failure is AuthFailure.NOT_A_MEMBER


def test_a_member_away_during_a_secret_rotation_still_gets_in(mesh, server_key, store):
    """The admitted key is the credential: a member whose mesh secret is older (it was off
    when a removal rotated it) links, and then learns the new one (mesh/member_sync.py)."""
    member = KeySigner()
    _admit(store, server_key, member.member())
    older = MeshCredentials(mesh_id=mesh.mesh_id, mesh_secret="an older generation")
    server = _server(server_key, mesh.rotated(), store)
    client = ClientHandshake(me=member, mesh_id=mesh.mesh_id, expected_peer=None, credentials=older)
    _run(client, server)
    assert server.state is client.state is HandshakeState.ACCEPTED


def test_a_key_the_facts_do_not_admit_is_refused_whatever_secret_it_shows(mesh, server_key, store):
    """The audit's plant: an address entry without an admission, and the real mesh secret."""
    plant = KeySigner()
    assert not store.note_member(plant.member(["127.0.0.1:7"]))  # gossip cannot plant it
    server = _server(server_key, mesh, store)
    _run(_member_client(plant, mesh, server_key.node_id), server)
    assert server.failure is AuthFailure.NOT_A_MEMBER


def test_member_key_swapped_refused(mesh, server_key, store):
    """Someone claiming a member's node id with another key."""
    member = KeySigner()
    _admit(store, server_key, member.member())
    impostor = KeySigner()
    impostor.node_id = member.node_id  # claims the id, but holds a different key
    server = _server(server_key, mesh, store)
    _run(_member_client(impostor, mesh, None), server)
    assert server.failure is AuthFailure.BAD_IDENTITY


def test_replayed_proof_refused(mesh, server_key, store):
    """A Proof captured from one session is useless in the next: the nonce differs."""
    member = KeySigner()
    _admit(store, server_key, member.member())
    first = _server(server_key, mesh, store)
    client = _member_client(member, mesh, None)
    challenge = first.receive(client.start())[0]
    proof = client.receive(challenge)[0]
    assert isinstance(proof, Proof)
    # The attacker replays Hello and Proof to a fresh session (fresh server nonce).
    second = _server(server_key, mesh, store)
    second.receive(client.start())
    reply = second.receive(proof)
    assert isinstance(reply[0], Denied) and second.failure is AuthFailure.BAD_SIGNATURE


def test_signature_bound_to_both_node_ids(mesh, server_key, store):
    """A proof made for server X does not open server Y, even with the same nonce."""
    member = KeySigner()
    _admit(store, server_key, member.member())
    other_key = KeySigner()
    x = _server(server_key, mesh, store, now=NOW)
    y = _server(other_key, mesh, copy.deepcopy(store), now=NOW)
    y.nonce = x.nonce
    client = _member_client(member, mesh, None)
    proof = client.receive(x.receive(client.start())[0])[0]
    y.receive(client.start())
    assert isinstance(y.receive(proof)[0], Denied)
    assert y.failure is AuthFailure.BAD_SIGNATURE


def test_node_id_not_hash_of_key_refused(mesh, server_key, store):
    server = _server(server_key, mesh, store)
    liar = KeySigner()
    hello = Hello(mode="member", mesh_id=mesh.mesh_id, node_id="0" * 64,
                  public_key=liar.public_key_bytes.hex(), nonce="n")  # fmt: skip
    assert isinstance(server.receive(hello)[0], Denied)
    assert server.failure is AuthFailure.BAD_IDENTITY


def test_transport_fingerprint_must_match_claim(mesh, server_key, store):
    member = KeySigner()
    _admit(store, server_key, member.member())
    server = ServerHandshake(me=server_key, credentials=mesh, store=store, now=NOW,
                             peer_fingerprint="seen-by-tls")  # fmt: skip
    client = _member_client(member, mesh, None)
    client.fingerprint = "something-else"
    _run(client, server)
    assert server.failure is AuthFailure.BAD_IDENTITY


def test_client_refuses_wrong_server(mesh, server_key, store):
    """The client expected another node id (e.g. the inviter): the server's key is wrong."""
    member = KeySigner()
    _admit(store, server_key, member.member())
    server = _server(server_key, mesh, store)
    client = _member_client(member, mesh, expected_peer=KeySigner().node_id)
    _run(client, server)
    assert client.failure is AuthFailure.WRONG_PEER
    assert server.state is not HandshakeState.ACCEPTED


def test_client_refuses_forged_challenge_signature(mesh, server_key, store):
    member = KeySigner()
    client = _member_client(member, mesh, server_key.node_id)
    client.start()
    forged = Challenge(node_id=server_key.node_id, public_key=server_key.public_key_bytes.hex(),
                       nonce="x", signature=server_key.sign(b"something else").hex())  # fmt: skip
    assert isinstance(client.receive(forged)[0], Denied)
    assert client.failure is AuthFailure.BAD_SIGNATURE


def test_out_of_order_message_is_protocol_error(mesh, server_key, store):
    server = _server(server_key, mesh, store)
    assert isinstance(server.receive(Proof(signature="00"))[0], Denied)
    assert server.failure is AuthFailure.PROTOCOL
    # After refusal nothing more happens.
    assert server.receive(Proof(signature="00")) == []


def test_join_welcome_without_secret_refused(mesh, server_key, store):
    token = _invite(mesh, server_key, store)
    client = ClientHandshake(me=KeySigner(), mesh_id=mesh.mesh_id, expected_peer=None,
                             invite=token)  # fmt: skip
    server = _server(server_key, mesh, store)
    proof = client.receive(server.receive(client.start())[0])[0]
    server.receive(proof)
    client.receive(Welcome(mesh_id=mesh.mesh_id, members=[]))
    assert client.failure is AuthFailure.PROTOCOL


@given(st.recursive(st.none() | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=10), inner), max_leaves=10))  # fmt: skip
def test_message_from_dict_raises_only_handshake_input_error(data):
    try:
        message_from_dict(data)
    except HandshakeInputError:
        pass


@given(st.dictionaries(st.sampled_from(["type", "mode", "node_id", "nonce", "signature"]),
                       st.one_of(st.text(max_size=20), st.integers(), st.none())))  # fmt: skip
def test_server_survives_any_first_message(body):
    """Whatever a stranger sends first, the server either challenges or refuses: no crash."""
    server = ServerHandshake(me=KeySigner(), credentials=MeshCredentials.create(),
                             store=MemberStore(), now=NOW)  # fmt: skip
    try:
        message = message_from_dict(body)
    except HandshakeInputError:
        return
    replies = server.receive(message)
    assert len(replies) == 1 and server.state in (
        HandshakeState.AWAIT_PROOF,
        HandshakeState.REFUSED,
    )


@pytest.mark.parametrize("data", [None, {}, [], {"type": "hello"}, "\xff"])
def test_message_from_dict_rejects_garbage(data):
    with pytest.raises(HandshakeInputError):
        message_from_dict(data)


# --------------------------------------------------------------------------- store


def test_store_never_replaces_a_members_key(server_key, store):
    other = KeySigner()
    hijack = Member(node_id=server_key.node_id, public_key=other.public_key_bytes.hex())
    assert not store.note_member(hijack)
    assert store.members[server_key.node_id].public_key == server_key.public_key_bytes.hex()


def test_store_takes_addresses_of_members_only(server_key, store):
    member, stranger = KeySigner(), KeySigner()
    _admit(store, server_key, member.member())
    bogus = Member(node_id="f" * 64, public_key=member.public_key_bytes.hex())
    assert not store.note_member(bogus) and not store.note_member(stranger.member(["1.2.3.4:5"]))
    assert set(store.members) == {server_key.node_id, member.node_id}
    assert store.note_member(member.member(["10.0.0.2:9338"]))


def test_files_are_private_and_roundtrip(tmp_path, mesh, server_key, store):
    _admit(store, server_key, KeySigner().member(["10.0.0.2:9338"]))
    store.remove(server_key, next(n for n in store.members if n != server_key.node_id), NOW, [])
    save_credentials(tmp_path, mesh)
    save_members(tmp_path, store)
    assert load_credentials(tmp_path) == mesh
    loaded = load_members(tmp_path)
    assert loaded.to_file() == store.to_file()
    assert loaded.members == store.members and loaded.removed == store.removed
    for name in ("mesh.json", "members.json"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600
    assert load_credentials(tmp_path / "nowhere") is None


def test_store_keeps_the_newest_addresses(server_key, store):
    member = KeySigner()
    _admit(store, server_key, member.member())
    fresh = member.member(["10.0.0.2:9338"]).model_copy(update={"updated_at": 200.0})
    stale = member.member(["10.0.0.2:1111"]).model_copy(update={"updated_at": 100.0})
    assert store.note_member(fresh)
    assert not store.note_member(stale)  # a second-hand old copy arrives through gossip
    assert store.members[member.node_id].addresses == ["10.0.0.2:9338"]
    newer = member.member(["10.0.0.3:9338"]).model_copy(update={"updated_at": 300.0})
    assert store.note_member(newer)
    assert store.members[member.node_id].addresses == ["10.0.0.3:9338"]


# --------------------------------------------------------------------------- removal


def test_a_removed_member_stays_out_of_every_merge_of_older_copies(mesh, server_key, store):
    key = KeySigner()
    _admit(store, server_key, key.member())
    old = list(store.ledger.admissions)  # type: ignore[union-attr]
    assert store.remove(server_key, key.node_id, NOW + 100, []).left == [key.node_id]
    assert key.node_id not in store.members and store.removed == {key.node_id: NOW + 100}
    assert not store.merge(old, [], NOW + 200).joined  # a stale copy from a peer's gossip
    assert not store.note_member(key.member(["10.0.0.9:9338"]))
    assert key.node_id not in store.members


def test_a_tombstone_travels_and_holds_against_later_entries(mesh, server_key, store):
    key = KeySigner()
    _admit(store, server_key, key.member())
    there = copy.deepcopy(store)
    store.remove(server_key, key.node_id, NOW + 100, [])
    ledger = store.ledger
    assert ledger is not None
    change = there.merge(list(ledger.admissions), list(ledger.tombstones), NOW + 200)
    assert change.left == [key.node_id] and there.removed[key.node_id] == NOW + 100
    again = there.merge(list(ledger.admissions), list(ledger.tombstones), NOW + 300)
    assert not again.left and not again.joined  # the same news again changes nothing


def test_a_newer_peers_extra_fields_are_ignored():
    hello = message_from_dict(
        {
            "type": "hello",
            "mode": "member",
            "mesh_id": "m",
            "node_id": "n",
            "public_key": "00",
            "nonce": "x",
            "capabilities": ["v2"],
        }
    )
    assert isinstance(hello, Hello) and hello.node_id == "n"
