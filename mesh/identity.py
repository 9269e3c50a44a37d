"""Node identity: an Ed25519 key and a long-lived self-signed certificate for it.

Layout in the home dir::

    <home>/identity/key.pem    Ed25519 private key, PKCS#8 PEM, mode 0600
    <home>/identity/cert.pem   self-signed X.509 certificate for that key (20 years)

* ``node_id`` = hex SHA-256 of the raw 32-byte public key. It names the node everywhere (peer
  table, gossip, invites) and is what the tunnel compares to detect a copied home dir.
* ``cert_fingerprint`` = hex SHA-256 of the certificate's DER. Invites pin it.
* The same key signs TLS 1.3 handshakes (aioquic supports the ed25519 signature scheme, checked
  by the tunnel tests), so the certificate a peer presents in the QUIC handshake proves its node
  id directly – no separate TLS key.

Usage::

    ident = NodeIdentity.load_or_create(home)
    sig = ident.sign(b"nonce")
    assert verify(ident.public_key_bytes, sig, b"nonce")
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.x509.oid import NameOID

from mesh.errors import IdentityError
from mesh.files import write_private, write_public

log = logging.getLogger(__name__)

CERT_VALIDITY = datetime.timedelta(days=365 * 20)
IDENTITY_DIR = "identity"
KEY_FILE = "key.pem"
CERT_FILE = "cert.pem"


def node_id_of(public_key: bytes | ed25519.Ed25519PublicKey) -> str:
    """Node id for a raw 32-byte Ed25519 public key (or key object): hex SHA-256."""
    if isinstance(public_key, ed25519.Ed25519PublicKey):
        public_key = _raw_public(public_key)
    return hashlib.sha256(public_key).hexdigest()


def cert_fingerprint_of(cert: x509.Certificate) -> str:
    """Hex SHA-256 of the certificate's DER encoding (what invites pin)."""
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def public_key_of_cert(cert: x509.Certificate) -> bytes:
    """Raw Ed25519 public key inside a certificate; IdentityError for any other key type."""
    key = cert.public_key()
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise IdentityError(f"certificate key is {type(key).__name__}, expected Ed25519")
    return _raw_public(key)


def node_id_of_cert(cert: x509.Certificate) -> str:
    """Node id of the key a certificate carries."""
    return node_id_of(public_key_of_cert(cert))


def verify(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """True iff ``signature`` is a valid Ed25519 signature of ``data`` by ``public_key`` (raw)."""
    try:
        ed25519.Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


SHORT_ID_LENGTH = 12


def short_id(node_id: str | None) -> str:
    """A node id as logs and people see it: its first 12 hex digits ("?" when not known yet)."""
    return node_id[:SHORT_ID_LENGTH] if node_id else "?"


@dataclass(frozen=True)
class NodeIdentity:
    """A node's private key and certificate. Create with :meth:`load_or_create`."""

    private_key: ed25519.Ed25519PrivateKey
    certificate: x509.Certificate

    @classmethod
    def generate(cls) -> NodeIdentity:
        """A fresh identity in memory (tests; ``load_or_create`` persists one)."""
        key = ed25519.Ed25519PrivateKey.generate()
        return cls(private_key=key, certificate=_self_signed_cert(key))

    @classmethod
    def load_or_create(cls, home: Path) -> NodeIdentity:
        """Load ``<home>/identity/{key,cert}.pem``; create both (key mode 0600) if absent."""
        directory = Path(home) / IDENTITY_DIR
        key_path, cert_path = directory / KEY_FILE, directory / CERT_FILE
        if key_path.exists():
            return cls._load(key_path, cert_path)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        ident = cls.generate()
        write_private(key_path, ident.key_pem)
        write_public(cert_path, ident.cert_pem)
        return ident

    @classmethod
    def _load(cls, key_path: Path, cert_path: Path) -> NodeIdentity:
        mode = stat.S_IMODE(key_path.stat().st_mode)
        if mode & 0o077:
            log.warning(
                "%s was readable by others (mode %o); restricting it to 0600", key_path, mode
            )
            os.chmod(key_path, 0o600)
        try:
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        except (ValueError, TypeError) as exc:
            raise IdentityError(f"{key_path}: not a readable private key ({exc})") from exc
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise IdentityError(f"{key_path}: expected an Ed25519 key, got {type(key).__name__}")
        if cert_path.exists():
            try:
                cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            except ValueError as exc:
                raise IdentityError(f"{cert_path}: not a readable certificate ({exc})") from exc
            if public_key_of_cert(cert) != _raw_public(key.public_key()):
                raise IdentityError(f"{cert_path} does not belong to the key in {key_path}")
        else:
            # The key is the identity; a lost certificate is simply re-issued.
            cert = _self_signed_cert(key)
            write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        return cls(private_key=key, certificate=cert)

    @property
    def public_key_bytes(self) -> bytes:
        """Raw 32-byte Ed25519 public key."""
        return _raw_public(self.private_key.public_key())

    @property
    def node_id(self) -> str:
        return node_id_of(self.public_key_bytes)

    @property
    def short_id(self) -> str:
        """First 12 hex digits of the node id, for logs and humans."""
        return short_id(self.node_id)

    @property
    def cert_fingerprint(self) -> str:
        return cert_fingerprint_of(self.certificate)

    @property
    def cert_pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def sign(self, data: bytes) -> bytes:
        """Ed25519 signature (64 bytes) of ``data``."""
        return self.private_key.sign(data)


def _raw_public(key: ed25519.Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _self_signed_cert(key: ed25519.Ed25519PrivateKey) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id_of(key.public_key()))])
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + CERT_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, algorithm=None)  # Ed25519 takes no separate hash
    )
