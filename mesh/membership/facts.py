"""The signed facts a mesh's member list is made of: pure data, signing and checking.

* :class:`Root` – the mesh creator's node id and key: a member by definition, never removed.
* :class:`Admission` – ``by`` admitted ``node_id`` (its ``public_key``), naming the invite it
  consumed (the invite secret's digest; ``migrated`` or ``kept`` for the two other ways in).
* :class:`Tombstone` – ``by`` removed ``node_id`` at ``at``; kept for good.

A signature covers a tag, the mesh id and every field, so a fact cannot be moved to another
node, signer or mesh; ``node_id`` must be the SHA-256 of ``public_key``. Whether a fact
*counts* (its signer a member, a tombstone before it) is the ledger's question
(:mod:`mesh.membership.ledger`); here a fact is only checked against a key.
"""

from __future__ import annotations

from typing import Annotated, Protocol

from pydantic import BaseModel, ConfigDict, Field

from mesh.identity import node_id_of
from mesh.identity import verify as verify_signature

FACT_TAG = b"mlxmesh-membership-v1"
MIGRATED = "migrated"  # admitted by this node's operator when signed membership arrived
KEPT = "kept"  # re-admitted by a remover so that it stays when its admitter goes

Hex64 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Signature = Annotated[str, Field(pattern=r"^[0-9a-f]{128}$")]


class Signer(Protocol):
    """A node's key as facts and handshakes need it (``mesh.identity.NodeIdentity`` is one)."""

    @property
    def node_id(self) -> str: ...

    @property
    def public_key_bytes(self) -> bytes: ...  # raw 32-byte Ed25519 public key

    def sign(self, data: bytes) -> bytes: ...


class _Fact(BaseModel):
    # Newer nodes may add fields: ignored (never signed over, so they change nothing).
    model_config = ConfigDict(extra="ignore", frozen=True)


class Root(_Fact):
    node_id: Hex64
    public_key: Hex64

    @classmethod
    def of(cls, signer: Signer) -> Root:
        return cls(node_id=signer.node_id, public_key=signer.public_key_bytes.hex())

    def is_consistent(self) -> bool:
        return node_id_of(bytes.fromhex(self.public_key)) == self.node_id


class Admission(_Fact):
    node_id: Hex64
    public_key: Hex64
    by: Hex64
    invite: str = Field(default="", max_length=64)
    at: float = Field(ge=0, allow_inf_nan=False)
    signature: Signature

    def signed_bytes(self, mesh_id: str) -> bytes:
        return _signed(
            b"admit", mesh_id, self.node_id, self.public_key, self.by, self.invite, self.at
        )

    def is_consistent(self) -> bool:
        """The node id is its key's hash, and nobody admits itself."""
        return (
            node_id_of(bytes.fromhex(self.public_key)) == self.node_id and self.by != self.node_id
        )


class Tombstone(_Fact):
    node_id: Hex64
    by: Hex64
    at: float = Field(ge=0, allow_inf_nan=False)
    signature: Signature

    def signed_bytes(self, mesh_id: str) -> bytes:
        return _signed(b"remove", mesh_id, self.node_id, self.by, self.at)


Fact = Admission | Tombstone


def _signed(kind: bytes, mesh_id: str, *fields: str | float) -> bytes:
    # repr() of a float is exact and survives a JSON round trip unchanged.
    parts = [FACT_TAG, kind, mesh_id.encode()]
    parts += [(repr(float(f)) if isinstance(f, float) else f).encode() for f in fields]
    return b"\0".join(parts)


def sign_admission(
    signer: Signer, mesh_id: str, node_id: str, public_key: str, invite: str, now: float
) -> Admission:
    unsigned = Admission(
        node_id=node_id,
        public_key=public_key,
        by=signer.node_id,
        invite=invite,
        at=now,
        signature="0" * 128,
    )
    signature = signer.sign(unsigned.signed_bytes(mesh_id)).hex()
    return unsigned.model_copy(update={"signature": signature})


def sign_tombstone(signer: Signer, mesh_id: str, node_id: str, now: float) -> Tombstone:
    unsigned = Tombstone(node_id=node_id, by=signer.node_id, at=now, signature="0" * 128)
    signature = signer.sign(unsigned.signed_bytes(mesh_id)).hex()
    return unsigned.model_copy(update={"signature": signature})


def signature_holds(fact: Fact, mesh_id: str, signer_key: str) -> bool:
    """True when ``fact`` was signed by the key ``signer_key`` (hex) for ``mesh_id``."""
    return verify_signature(
        bytes.fromhex(signer_key), bytes.fromhex(fact.signature), fact.signed_bytes(mesh_id)
    )
