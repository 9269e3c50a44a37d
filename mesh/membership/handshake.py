"""Mesh membership: the member store and the sans-IO join/auth handshake.

Who may talk to whom: a node is a member when the mesh's signed facts admit its Ed25519 key
(:mod:`mesh.membership.ledger`). A newcomer becomes a member by presenting a one-use invite
secret: the inviter then signs its admission. A member proves it still is one by signing a fresh
nonce with its admitted key; it also sends a MAC with the mesh secret, which nodes of the
previous version check and this one does not (a rotation must not lock out a node that was away
while it happened). Both sides are pure objects fed messages (``receive``) that return the
messages to send; the tunnel adapter carries them.

Handshake (client dials server; the client already pinned the server's certificate)::

    client                                       server
    Hello{node_id, public_key, nonce_c, mode}  →
                                               ←  Challenge{node_id, public_key, nonce_s,
                                                            sig_s(server, ids, nonce_c)}
    Proof{sig_c(client, ids, nonce_s),
          invite_secret | mesh_mac}            →
                                               ←  Welcome{mesh_id, root, admissions,
                                                          tombstones, members, mesh_secret?}
                                                  or Denied{reason} → close AUTH_FAILED

Signatures cover a role tag, both node ids and the *other* side's fresh nonce, so a captured
signature is useless in any other session (no replay) and against any other node.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mesh.errors import HandshakeInputError
from mesh.identity import node_id_of
from mesh.identity import verify as verify_signature
from mesh.membership.codec import MessageCodec
from mesh.membership.facts import Admission, Root, Signer, Tombstone
from mesh.membership.invite import InviteToken, secret_matches
from mesh.membership.ledger import (
    MAX_MESSAGE_ADMISSIONS,
    MAX_MESSAGE_MEMBERS,
    MAX_MESSAGE_TOMBSTONES,
)
from mesh.membership.members import Member, MemberStore, MeshCredentials

log = logging.getLogger(__name__)

PROTOCOL_TAG = b"mlxmesh-auth-v1"


def transcript(role: str, signer: str, verifier: str, nonce: str) -> bytes:
    """The bytes a side signs: role, who signs, for whom, and the other side's nonce."""
    return b"\0".join(
        [PROTOCOL_TAG, role.encode(), signer.encode(), verifier.encode(), nonce.encode()]
    )


def mesh_mac(mesh_secret: str, data: bytes) -> str:
    return hmac.new(mesh_secret.encode(), data, hashlib.sha256).hexdigest()


# --------------------------------------------------------------------------- messages


class _Msg(BaseModel):
    # A newer peer may add fields: ignored, as in gossip (what is signed is the transcript,
    # never the message, so an ignored field cannot change what a signature covers).
    model_config = ConfigDict(extra="ignore")


class Hello(_Msg):
    type: Literal["hello"] = "hello"
    mode: Literal["join", "member"]
    mesh_id: str
    node_id: str
    public_key: str
    fingerprint: str = ""
    addresses: list[str] = Field(default_factory=list)
    nonce: str


class Challenge(_Msg):
    type: Literal["challenge"] = "challenge"
    node_id: str
    public_key: str
    nonce: str
    signature: str


class Proof(_Msg):
    type: Literal["proof"] = "proof"
    signature: str
    invite_secret: str | None = None
    mesh_mac: str | None = None


class Welcome(_Msg):
    type: Literal["welcome"] = "welcome"
    mesh_id: str
    members: list[Member] = Field(max_length=MAX_MESSAGE_MEMBERS)  # their addresses
    mesh_secret: str | None = None  # only to a newcomer
    secret_generation: int = 0
    # The signed facts (None from a node of the previous version, which has none).
    root: Root | None = None
    admissions: list[Admission] = Field(default_factory=list, max_length=MAX_MESSAGE_ADMISSIONS)
    tombstones: list[Tombstone] = Field(default_factory=list, max_length=MAX_MESSAGE_TOMBSTONES)


class Denied(_Msg):
    type: Literal["denied"] = "denied"
    reason: str


HandshakeMessage = Hello | Challenge | Proof | Welcome | Denied
# Bad input raises HandshakeInputError only: anything that is not one of our messages.
_CODEC: MessageCodec[HandshakeMessage] = MessageCodec(
    HandshakeMessage, HandshakeInputError, "handshake message"
)
message_from_dict = _CODEC.from_dict


INVITE_RETRY_S = 300.0  # a joiner whose Welcome was lost may present its used invite this long


class AuthFailure(enum.StrEnum):
    """Why a handshake was refused (sent in ``Denied`` and logged; the tunnel closes AUTH_FAILED)."""

    PROTOCOL = "protocol"
    WRONG_MESH = "wrong_mesh"
    BAD_IDENTITY = "bad_identity"  # node id is not the hash of the key / key mismatch
    NOT_A_MEMBER = "not_a_member"
    REMOVED = "removed"  # removed from the mesh: refused whatever invite or secret it shows
    BAD_SIGNATURE = "bad_signature"
    BAD_INVITE = "bad_invite"  # unknown secret
    INVITE_EXPIRED = "invite_expired"
    INVITE_USED = "invite_used"
    BAD_MESH_MAC = "bad_mesh_mac"  # (only nodes of the previous version still check it)
    MESH_FULL = "mesh_full"  # the members cap: the inviter could not admit one more
    WRONG_PEER = "wrong_peer"  # the server is not who the client meant to dial
    DENIED = "denied"  # the other side refused us


class HandshakeState(enum.Enum):
    AWAIT_HELLO = "await_hello"
    AWAIT_CHALLENGE = "await_challenge"
    AWAIT_PROOF = "await_proof"
    AWAIT_WELCOME = "await_welcome"
    ACCEPTED = "accepted"
    REFUSED = "refused"


def _new_nonce() -> str:
    return secrets.token_hex(32)


@dataclass
class _Handshake:
    state: HandshakeState = field(init=False)
    failure: AuthFailure | None = field(init=False, default=None)
    peer: Member | None = field(init=False, default=None)
    denied_reason: str = field(init=False, default="")  # what the other side said when it refused

    def _set_state(self, state: HandshakeState) -> None:
        log.debug("%s %s -> %s", type(self).__name__, self.state.value, state.value)
        self.state = state

    @property
    def done(self) -> bool:
        return self.state in (HandshakeState.ACCEPTED, HandshakeState.REFUSED)

    def _refuse(self, reason: AuthFailure) -> list[HandshakeMessage]:
        self.failure = reason
        self._set_state(HandshakeState.REFUSED)
        return [Denied(reason=reason.value)]

    def receive(self, message: HandshakeMessage) -> list[HandshakeMessage]:
        """Feed one message from the peer; returns the messages to send back."""
        handler = self._handlers().get((self.state, type(message)))
        if handler is None:
            if isinstance(message, Denied) and not self.done:
                self.failure = AuthFailure.DENIED
                self.denied_reason = message.reason
                self._set_state(HandshakeState.REFUSED)
                return []
            return [] if self.done else self._refuse(AuthFailure.PROTOCOL)
        return handler(message)

    def _handlers(self) -> dict[tuple[HandshakeState, type], Callable[..., list[HandshakeMessage]]]:
        raise NotImplementedError


def _check_identity(node_id: str, public_key_hex: str) -> bytes | None:
    try:
        key = bytes.fromhex(public_key_hex)
    except ValueError:
        return None
    return key if len(key) == 32 and node_id_of(key) == node_id else None


@dataclass
class ServerHandshake(_Handshake):
    """The accepting side. ``store`` is mutated (member added, invite consumed) on success.

    ``peer_fingerprint`` / ``peer_node_id``: what the transport (mutual TLS) saw, when it saw
    it; the client's claims must then match.
    """

    me: Signer
    credentials: MeshCredentials
    store: MemberStore
    now: float
    peer_fingerprint: str | None = None
    peer_node_id: str | None = None
    nonce: str = field(default_factory=_new_nonce)
    _hello: Hello | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.state = HandshakeState.AWAIT_HELLO

    def _handlers(self):
        return {
            (HandshakeState.AWAIT_HELLO, Hello): self._on_hello,
            (HandshakeState.AWAIT_PROOF, Proof): self._on_proof,
        }

    def _on_hello(self, hello: Hello) -> list[HandshakeMessage]:
        if hello.mesh_id != self.credentials.mesh_id:
            return self._refuse(AuthFailure.WRONG_MESH)
        if _check_identity(hello.node_id, hello.public_key) is None:
            return self._refuse(AuthFailure.BAD_IDENTITY)
        if self.peer_fingerprint is not None and hello.fingerprint != self.peer_fingerprint:
            return self._refuse(AuthFailure.BAD_IDENTITY)
        if self.peer_node_id is not None and hello.node_id != self.peer_node_id:
            return self._refuse(AuthFailure.BAD_IDENTITY)
        if hello.node_id in self.store.removed:
            return self._refuse(AuthFailure.REMOVED)
        if hello.mode == "member":
            key = self.store.key_of(hello.node_id)  # admitted by the signed facts, or None
            if key is None:
                return self._refuse(AuthFailure.NOT_A_MEMBER)
            if key != hello.public_key:
                return self._refuse(AuthFailure.BAD_IDENTITY)
        self._hello = hello
        signature = self.me.sign(transcript("server", self.me.node_id, hello.node_id, hello.nonce))
        self._set_state(HandshakeState.AWAIT_PROOF)
        return [
            Challenge(
                node_id=self.me.node_id,
                public_key=self.me.public_key_bytes.hex(),
                nonce=self.nonce,
                signature=signature.hex(),
            )
        ]

    def _on_proof(self, proof: Proof) -> list[HandshakeMessage]:
        hello = self._hello
        assert hello is not None
        signed = transcript("client", hello.node_id, self.me.node_id, self.nonce)
        try:
            signature = bytes.fromhex(proof.signature)
        except ValueError:
            return self._refuse(AuthFailure.BAD_SIGNATURE)
        if not verify_signature(bytes.fromhex(hello.public_key), signature, signed):
            return self._refuse(AuthFailure.BAD_SIGNATURE)
        self.peer = Member(
            node_id=hello.node_id,
            public_key=hello.public_key,
            fingerprint=hello.fingerprint,
            addresses=hello.addresses,
            updated_at=self.now,
        )
        if hello.mode == "join":
            invite = self._consume_invite(proof.invite_secret, hello.node_id)
            if isinstance(invite, AuthFailure):
                return self._refuse(invite)
            # Signed here, naming the invite: the newcomer's way in that every member checks.
            self.store.admit(self.me, self.peer, invite, self.now)
            if self.store.key_of(hello.node_id) is None:
                return self._refuse(AuthFailure.MESH_FULL)
        # (Member mode: the admitted key signed our nonce; that is the credential. The MAC
        # the client sends is for nodes of the previous version.)
        self.store.note_member(self.peer)
        self._set_state(HandshakeState.ACCEPTED)
        return [self._welcome(join=hello.mode == "join")]

    def _welcome(self, join: bool) -> Welcome:
        ledger = self.store.ledger
        assert ledger is not None  # a node that admits is a member: it has a ledger
        return Welcome(
            mesh_id=self.credentials.mesh_id,
            members=list(self.store.members.values()),
            mesh_secret=self.credentials.mesh_secret if join else None,
            secret_generation=self.credentials.secret_generation,
            root=ledger.root,
            admissions=sorted(ledger.admissions, key=lambda a: a.at),
            tombstones=sorted(ledger.tombstones, key=lambda t: t.at),
        )

    def _consume_invite(self, secret: str | None, joiner: str) -> str | AuthFailure:
        """The invite's digest (what the admission names), or why it cannot be used."""
        if not secret:
            return AuthFailure.BAD_INVITE
        for digest, record in self.store.invites.items():
            if not secret_matches(secret, digest):
                continue
            if record.used_by is not None:
                # The same joiner retrying soon after a lost Welcome is not a reuse; the same
                # token shown again later is (one use, however long the token would live).
                retry = record.used_by == joiner and self.now < record.used_at + INVITE_RETRY_S
                return digest if retry else AuthFailure.INVITE_USED
            if self.now >= record.expires_at:
                return AuthFailure.INVITE_EXPIRED
            record.used_by, record.used_at = joiner, self.now
            return digest
        return AuthFailure.BAD_INVITE


@dataclass
class ClientHandshake(_Handshake):
    """The dialing side. Join mode when ``invite`` is given, else member mode.

    ``expected_peer``: the node id we meant to dial (the inviter, or a known member); the server
    must prove it holds that key. ``credentials`` (member mode) are required for the mesh MAC.
    """

    me: Signer
    mesh_id: str
    expected_peer: str | None
    invite: InviteToken | None = None
    credentials: MeshCredentials | None = None
    fingerprint: str = ""
    addresses: list[str] = field(default_factory=list)
    nonce: str = field(default_factory=_new_nonce)
    welcome: Welcome | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.state = HandshakeState.AWAIT_CHALLENGE
        if self.invite is None and self.credentials is None:
            raise ValueError("member mode needs mesh credentials")

    def start(self) -> Hello:
        return Hello(
            mode="join" if self.invite is not None else "member",
            mesh_id=self.mesh_id,
            node_id=self.me.node_id,
            public_key=self.me.public_key_bytes.hex(),
            fingerprint=self.fingerprint,
            addresses=self.addresses,
            nonce=self.nonce,
        )

    def _handlers(self):
        return {
            (HandshakeState.AWAIT_CHALLENGE, Challenge): self._on_challenge,
            (HandshakeState.AWAIT_WELCOME, Welcome): self._on_welcome,
        }

    def _on_challenge(self, challenge: Challenge) -> list[HandshakeMessage]:
        if self.expected_peer is not None and challenge.node_id != self.expected_peer:
            return self._refuse(AuthFailure.WRONG_PEER)
        key = _check_identity(challenge.node_id, challenge.public_key)
        if key is None:
            return self._refuse(AuthFailure.BAD_IDENTITY)
        signed = transcript("server", challenge.node_id, self.me.node_id, self.nonce)
        try:
            signature = bytes.fromhex(challenge.signature)
        except ValueError:
            return self._refuse(AuthFailure.BAD_SIGNATURE)
        if not verify_signature(key, signature, signed):
            return self._refuse(AuthFailure.BAD_SIGNATURE)
        self.peer = Member(node_id=challenge.node_id, public_key=challenge.public_key)
        mine = transcript("client", self.me.node_id, challenge.node_id, challenge.nonce)
        proof = Proof(signature=self.me.sign(mine).hex())
        if self.invite is not None:
            proof.invite_secret = self.invite.secret
        else:
            assert self.credentials is not None
            proof.mesh_mac = mesh_mac(self.credentials.mesh_secret, mine)
        self._set_state(HandshakeState.AWAIT_WELCOME)
        return [proof]

    def _on_welcome(self, welcome: Welcome) -> list[HandshakeMessage]:
        if welcome.mesh_id != self.mesh_id:
            return self._refuse(AuthFailure.WRONG_MESH)
        if self.invite is not None and not welcome.mesh_secret:
            return self._refuse(AuthFailure.PROTOCOL)
        self.welcome = welcome
        assert self.peer is not None
        for member in welcome.members:
            if member.node_id == self.peer.node_id:
                self.peer = member
        self._set_state(HandshakeState.ACCEPTED)
        return []
