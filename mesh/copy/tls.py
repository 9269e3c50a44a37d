"""TLS 1.3 contexts for the copy channel, trusting exactly the certificates of members.

Both sides present their node certificate (the same Ed25519 key the QUIC tunnel uses). The
certificates are self-signed, so each side loads the certificates it accepts as its ONLY trust
anchors (``cadata``): OpenSSL 3 takes a self-signed Ed25519 end-entity certificate as a trust
anchor, so the handshake itself refuses a stranger – the server with ``CERT_REQUIRED`` asks for
and checks the client's certificate. Host names mean nothing here (``check_hostname=False``);
after the handshake :func:`peer_node_id` maps the presented certificate back to a node id, and
the caller checks that id against the member table (a removed member's certificate may still be
in an older context).
"""

from __future__ import annotations

import asyncio
import os
import ssl
import tempfile
from collections.abc import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from mesh.errors import AuthFailed, IdentityError
from mesh.identity import NodeIdentity, node_id_of_cert


def make_context(
    identity: NodeIdentity, trusted: Iterable[bytes], *, server: bool
) -> ssl.SSLContext:
    """A TLS 1.3-only context presenting ``identity`` and trusting only the DER ``trusted``."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    pems = "".join(
        x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM).decode()
        for der in trusted
    )
    if pems:
        ctx.load_verify_locations(cadata=pems)
    _load_identity(ctx, identity)
    return ctx


def _load_identity(ctx: ssl.SSLContext, identity: NodeIdentity) -> None:
    # ssl loads keys only from files: a private temp dir, gone right after loading.
    with tempfile.TemporaryDirectory(prefix="mesh-copy-") as tmp:
        key, cert = os.path.join(tmp, "key.pem"), os.path.join(tmp, "cert.pem")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(identity.key_pem)
        with open(cert, "wb") as fh:
            fh.write(identity.cert_pem)
        ctx.load_cert_chain(cert, key)


def peer_node_id(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> str:
    """The node id of the certificate the other side presented; ``AuthFailed`` if none."""
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    if not der:
        raise AuthFailed("the peer presented no certificate on the copy channel")
    try:
        return node_id_of_cert(x509.load_der_x509_certificate(der))
    except (ValueError, IdentityError) as exc:
        raise AuthFailed(f"the peer's certificate is unusable: {exc}") from None


def cert_der(identity_or_cert: NodeIdentity | x509.Certificate) -> bytes:
    cert = (
        identity_or_cert.certificate
        if isinstance(identity_or_cert, NodeIdentity)
        else identity_or_cert
    )
    return cert.public_bytes(serialization.Encoding.DER)


def recv_exactly(sock: ssl.SSLSocket, n: int) -> bytes:
    """Exactly ``n`` bytes from a blocking TLS socket (``IncompleteReadError`` at EOF)."""
    buf = bytearray(n)
    recv_into_exactly(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exactly(sock: ssl.SSLSocket, view: memoryview) -> None:
    """Fill ``view`` from a blocking TLS socket: each record is decrypted straight into it."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise asyncio.IncompleteReadError(bytes(view[:got]), n)
        got += k
