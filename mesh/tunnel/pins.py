"""Who is on the other end of a tunnel connection: certificate pinning and node-id checks.

Pure except for reading the certificate off aioquic's TLS context. aioquic exposes neither the
peer certificate nor client-certificate requests publicly; both private touch points live here
so an aioquic upgrade that moves them breaks one small module (and the tunnel tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aioquic.quic.connection import QuicConnection
from cryptography import x509

from mesh.errors import AuthFailed, DuplicateNodeError, IdentityError
from mesh.identity import cert_fingerprint_of, node_id_of_cert, public_key_of_cert, short_id


@dataclass(frozen=True)
class Pin:
    """What the dialer expects the peer to be: a certificate fingerprint and/or a node id."""

    fingerprint: str | None = None
    node_id: str | None = None


@dataclass(frozen=True)
class PeerIdentity:
    """What the peer proved in the TLS handshake (it signed with this certificate's key)."""

    certificate: x509.Certificate
    public_key: bytes
    node_id: str
    cert_fingerprint: str


def verify_peer(
    cert: x509.Certificate | None, own_node_id: str, pin: Pin | None, where: object
) -> PeerIdentity:
    """Check the peer's certificate: present, Ed25519, not our own id, and matching ``pin``.

    Raises ``AuthFailed`` or ``DuplicateNodeError`` (a copied home dir) with a clear message."""
    if cert is None:
        raise AuthFailed(f"peer at {where} presented no certificate")
    try:
        public_key = public_key_of_cert(cert)
    except IdentityError as exc:
        raise AuthFailed(f"peer certificate unusable: {exc}") from None
    peer = PeerIdentity(cert, public_key, node_id_of_cert(cert), cert_fingerprint_of(cert))
    if peer.node_id == own_node_id:
        raise DuplicateNodeError(
            f"peer at {where} runs with OUR node id {short_id(peer.node_id)}: two nodes share one "
            "identity (a copied home dir?). Give one of them a fresh home dir; refusing the "
            "connection."
        )
    if pin is not None:
        if pin.fingerprint and pin.fingerprint.lower() != peer.cert_fingerprint:
            raise AuthFailed(
                f"certificate pin mismatch at {where}: expected {pin.fingerprint[:16]}…, "
                f"got {peer.cert_fingerprint[:16]}…"
            )
        if pin.node_id and pin.node_id.lower() != peer.node_id:
            raise AuthFailed(
                f"node id mismatch at {where}: expected {short_id(pin.node_id)}, got {short_id(peer.node_id)}"
            )
    return peer


def peer_certificate(quic: QuicConnection) -> x509.Certificate | None:
    """The certificate the peer presented. aioquic keeps it on the TLS context only."""
    tls: Any = getattr(quic, "tls", None)
    return getattr(tls, "_peer_certificate", None)


# Fail loudly (the handshake aborts, the log says why) rather than run without client certs.
_AIOQUIC_CHANGED = (
    "this aioquic version lacks the private hooks mesh uses to request client certificates "
    "(QuicConnection._initialize, tls._request_client_certificate); install aioquic 1.2-1.7"
)


def request_client_certificate(quic: QuicConnection) -> None:
    """Make a server-side connection ask for the client's certificate (mutual TLS).

    aioquic's TLS server can send a CertificateRequest and verifies the client's
    CertificateVerify signature, but only behind a private flag on the TLS context it creates
    on the first datagram. We wrap that creation step for this one connection. The chain is
    not verified (self-signed by design): ``verify_peer`` pins and checks node ids."""
    initialize = getattr(quic, "_initialize", None)
    if initialize is None:
        raise RuntimeError(_AIOQUIC_CHANGED)

    def initialize_with_client_cert(peer_cid: bytes) -> None:
        initialize(peer_cid)
        if not hasattr(quic.tls, "_request_client_certificate"):
            raise RuntimeError(_AIOQUIC_CHANGED)
        quic.tls._request_client_certificate = True

    quic._initialize = initialize_with_client_cert  # type: ignore[method-assign]
