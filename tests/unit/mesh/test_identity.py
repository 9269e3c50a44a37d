"""Node identity: persistence, file modes, node id, signatures, certificate checks."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from mesh.errors import IdentityError
from mesh.identity import NodeIdentity, node_id_of_cert, verify


def test_created_once_then_loaded(tmp_path: Path) -> None:
    first = NodeIdentity.load_or_create(tmp_path)
    again = NodeIdentity.load_or_create(tmp_path)
    assert first.node_id == again.node_id
    assert first.cert_fingerprint == again.cert_fingerprint
    key_file = tmp_path / "identity" / "key.pem"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "identity").stat().st_mode) & 0o077 == 0
    assert key_file.read_bytes() == first.key_pem
    assert (tmp_path / "identity" / "cert.pem").read_bytes() == first.cert_pem


def test_node_id_is_sha256_of_raw_public_key() -> None:
    ident = NodeIdentity.generate()
    assert len(ident.public_key_bytes) == 32
    assert ident.node_id == hashlib.sha256(ident.public_key_bytes).hexdigest()
    assert node_id_of_cert(ident.certificate) == ident.node_id
    der = ident.certificate.public_bytes(serialization.Encoding.DER)
    assert ident.cert_fingerprint == hashlib.sha256(der).hexdigest()


def test_certificate_is_long_lived() -> None:
    cert = NodeIdentity.generate().certificate
    years = (cert.not_valid_after_utc - cert.not_valid_before_utc).days / 365
    assert years >= 19


def test_sign_and_verify() -> None:
    ident, other = NodeIdentity.generate(), NodeIdentity.generate()
    sig = ident.sign(b"nonce")
    assert verify(ident.public_key_bytes, sig, b"nonce")
    assert not verify(ident.public_key_bytes, sig, b"other nonce")
    assert not verify(other.public_key_bytes, sig, b"nonce")
    assert not verify(b"short", sig, b"nonce")


def test_distinct_nodes_have_distinct_ids() -> None:
    assert NodeIdentity.generate().node_id != NodeIdentity.generate().node_id


def test_lost_certificate_is_reissued_for_the_same_key(tmp_path: Path) -> None:
    first = NodeIdentity.load_or_create(tmp_path)
    (tmp_path / "identity" / "cert.pem").unlink()
    again = NodeIdentity.load_or_create(tmp_path)
    assert again.node_id == first.node_id


def test_foreign_certificate_is_refused(tmp_path: Path) -> None:
    NodeIdentity.load_or_create(tmp_path)
    (tmp_path / "identity" / "cert.pem").write_bytes(NodeIdentity.generate().cert_pem)
    with pytest.raises(IdentityError, match="does not belong"):
        NodeIdentity.load_or_create(tmp_path)


def test_garbage_key_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "identity").mkdir()
    (tmp_path / "identity" / "key.pem").write_bytes(b"not a key")
    with pytest.raises(IdentityError, match="key"):
        NodeIdentity.load_or_create(tmp_path)


def test_ed25519_key_type() -> None:
    assert isinstance(NodeIdentity.generate().private_key, ed25519.Ed25519PrivateKey)


def test_loose_key_permissions_are_tightened(tmp_path: Path) -> None:
    first = NodeIdentity.load_or_create(tmp_path)
    key_file = tmp_path / "identity" / "key.pem"
    key_file.chmod(0o644)
    assert NodeIdentity.load_or_create(tmp_path).node_id == first.node_id
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600


def test_home_files_keep_their_modes_whatever_the_umask(tmp_path) -> None:
    """A permissive umask must not make the certificate writable or the home listable by others."""
    import os

    from mesh.files import make_home

    def mode(path: Path) -> int:
        return stat.S_IMODE(path.stat().st_mode)

    home = tmp_path / "home"
    old = os.umask(0)
    try:
        make_home(home)
        NodeIdentity.load_or_create(home)
    finally:
        os.umask(old)
    assert mode(home) == 0o700
    certs = list(home.rglob("*.pem"))
    assert certs and all(mode(p) in (0o600, 0o644) for p in certs)
    assert all(mode(p) & 0o022 == 0 for p in home.rglob("*"))
