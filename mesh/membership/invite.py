"""Invite tokens: what ``mesh invite`` prints and ``mesh up --join TOKEN`` consumes.

A token is ``mlxmesh1.`` + base64url (no padding) of a JSON object. It carries everything a
joiner needs to dial the inviter and prove it was invited: the mesh id, the inviter's node id
and certificate fingerprint (the pin), the inviter's addresses, a one-use secret and an expiry.
It never carries the mesh secret: the inviter hands that out only after the handshake.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
import secrets

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mesh.errors import InviteError

TOKEN_PREFIX = "mlxmesh1."
DEFAULT_TTL_S = 3600.0
MAX_TTL_S = 30 * 86400.0  # an invite is for joining soon, not a standing key


class InviteToken(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    mesh_id: str
    inviter: str = Field(description="node id of the inviting node")
    fingerprint: str = Field(description="SHA-256 fingerprint of the inviter's certificate")
    addresses: list[str] = Field(description="host:port of the inviter's mesh (QUIC) endpoint")
    secret: str = Field(description="one-use invite secret (base64url)")
    expires_at: float = Field(description="unix time after which the token is refused")

    def encode(self) -> str:
        raw = orjson.dumps(self.model_dump())
        return TOKEN_PREFIX + base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")

    def is_expired(self, now: float) -> bool:
        return now >= self.expires_at


def make_invite(
    *,
    mesh_id: str,
    inviter: str,
    fingerprint: str,
    addresses: list[str],
    now: float,
    ttl_s: float = DEFAULT_TTL_S,
) -> InviteToken:
    """A fresh token with a new random secret. The inviter must remember ``secret_digest``."""
    if ttl_s <= 0:
        raise InviteError("invite ttl must be positive")
    return InviteToken(
        mesh_id=mesh_id,
        inviter=inviter,
        fingerprint=fingerprint,
        addresses=list(addresses),
        secret=secrets.token_urlsafe(32),
        expires_at=now + ttl_s,
    )


def decode_invite(token: str) -> InviteToken:
    """Parse a token string; raises :class:`InviteError` with a one-line reason."""
    token = token.strip()
    if not token.startswith(TOKEN_PREFIX):
        raise InviteError(f"not an mlx-mesh invite (expected prefix {TOKEN_PREFIX!r})")
    body = token[len(TOKEN_PREFIX) :]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        return InviteToken.model_validate(orjson.loads(raw))
    except (binascii.Error, ValueError, orjson.JSONDecodeError, ValidationError) as exc:
        raise InviteError(f"malformed invite token: {exc.__class__.__name__}") from exc


def secret_digest(secret: str) -> str:
    """What the inviter stores: a digest, so a leaked members file does not leak live invites."""
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(secret: str, digest: str) -> bool:
    return hmac.compare_digest(secret_digest(secret), digest)


def parse_ttl(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``1h``, ``2d`` → seconds."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    text = text.strip().lower()
    try:
        if text and text[-1] in units:
            value = float(text[:-1]) * units[text[-1]]
        else:
            value = float(text)
    except ValueError as exc:
        raise InviteError(f"bad ttl {text!r}: use e.g. 90s, 15m, 1h, 2d") from exc
    if not math.isfinite(value) or value <= 0:
        raise InviteError(f"bad ttl {text!r}: it must be a positive time, e.g. 1h")
    if value > MAX_TTL_S:
        raise InviteError(f"ttl {text!r} is too long: an invite lives at most 30d")
    return value
