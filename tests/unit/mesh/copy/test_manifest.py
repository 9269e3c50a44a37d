"""The model manifest: built from a directory, checked against tampering, chunks verified."""

from __future__ import annotations

import hashlib
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.copy.manifest import (
    FileEntry,
    ModelManifest,
    build_manifest,
    check_manifest,
    chunk_count,
    iter_chunks,
    manifest_from_json,
    model_files,
    verify_chunk,
)
from mesh.copy.server import TokenBucket
from mesh.errors import ChunkMismatch, ManifestError


def _model(tmp_path, sizes: dict[str, int]):
    root = tmp_path / "m"
    for rel, size in sizes.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes((i * 7 + len(rel)) % 251 for i in range(size)))
    return root


def test_build_lists_files_sizes_and_chunk_hashes(tmp_path):
    root = _model(tmp_path, {"config.json": 10, "model.safetensors": 2500, "sub/tok.json": 0})
    (root / ".hidden").write_bytes(b"x")
    manifest = build_manifest(root, "m", chunk_size=1000)
    check_manifest(manifest, "m")
    assert [f.path for f in manifest.files] == ["config.json", "model.safetensors", "sub/tok.json"]
    weights = manifest.file("model.safetensors")
    assert weights.size == 2500 and len(weights.chunks) == 3
    data = (root / "model.safetensors").read_bytes()
    assert weights.sha256 == hashlib.sha256(data).hexdigest()
    assert weights.chunks[2] == hashlib.sha256(data[2000:]).hexdigest()
    assert manifest.file("sub/tok.json").chunks == []
    assert manifest.total_bytes == 2510
    chunks = [c for c in iter_chunks(manifest) if c.path == "model.safetensors"]
    assert [(c.offset, c.length) for c in chunks] == [(0, 1000), (1000, 1000), (2000, 500)]
    verify_chunk(chunks[2], data[2000:])
    with pytest.raises(ChunkMismatch, match="SHA-256"):
        verify_chunk(chunks[1], data[:1000])
    with pytest.raises(ChunkMismatch, match="bytes"):
        verify_chunk(chunks[1], data[1000:1999])


def test_same_bytes_same_digest_and_subset(tmp_path):
    root = _model(tmp_path, {"a": 5, "b": 6})
    one, two = build_manifest(root, "m", 4), build_manifest(root, "m", 4)
    assert one.digest() == two.digest()
    assert [f.path for f in one.subset(["b"]).files] == ["b"]
    with pytest.raises(ManifestError, match="no file 'c'"):
        one.subset(["c"])
    (root / "a").write_bytes(b"other")
    assert build_manifest(root, "m", 4).digest() != one.digest()


def _entry(path="a", size=3, chunks=None) -> FileEntry:
    digest = "0" * 64
    return FileEntry(path=path, size=size, sha256=digest, chunks=chunks or [digest])


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ([], "no files"),
        ([_entry("../etc/passwd")], "unsafe"),
        ([_entry("/abs")], "unsafe"),
        ([_entry("a/./b")], "unsafe"),
        ([_entry(".git/config")], "unsafe"),
        ([_entry("a\\b")], "unsafe"),
        ([_entry("a"), _entry("a")], "twice"),
        ([_entry(size=9000)], "chunk hashes"),
        ([_entry(chunks=["xyz"])], "SHA-256"),
        # Where the file hash follows from the chunk list, it must: one chunk, or no bytes.
        ([_entry(chunks=["1" * 64])], "hash of its only chunk"),
        ([FileEntry(path="e", size=0, sha256="0" * 64)], "hash of no bytes"),
    ],
)
def test_tampered_manifests_are_refused(files, message):
    manifest = ModelManifest(name="m", chunk_size=4096, files=files)
    with pytest.raises(ManifestError, match=message):
        check_manifest(manifest)


def test_manifest_from_json_checks_name_and_shape():
    good = ModelManifest(name="m", chunk_size=4096, files=[_entry()])
    assert manifest_from_json(good.model_dump_json(), "m") == good
    with pytest.raises(ManifestError, match="asked for model 'n'"):
        manifest_from_json(good.model_dump_json(), "n")
    with pytest.raises(ManifestError, match="not a model manifest"):
        manifest_from_json(b'{"name": 3}')


@settings(deadline=None)
@given(st.integers(0, 10**6), st.integers(64, 10**5))
def test_chunks_cover_each_file_exactly(size, step):
    entry = FileEntry(
        path="f", size=size, sha256="0" * 64, chunks=["0" * 64] * chunk_count(size, step)
    )
    manifest = ModelManifest(name="m", chunk_size=step, files=[entry])
    chunks = list(iter_chunks(manifest))
    assert sum(c.length for c in chunks) == size
    assert all(0 < c.length <= step for c in chunks)
    assert all(b.offset == a.offset + a.length for a, b in itertools.pairwise(chunks))


def test_model_files_skips_symlinks(tmp_path):
    root = _model(tmp_path, {"a": 1})
    (root / "link").symlink_to(root / "a")
    assert model_files(root) == ["a"]


def test_token_bucket_paces_bytes():
    bucket = TokenBucket(rate=100.0, burst=100.0)
    assert bucket.delay(100, now=0.0) == 0.0
    assert bucket.delay(50, now=0.0) == pytest.approx(0.5)
    assert bucket.delay(0, now=2.0) == 0.0  # refilled (to the burst) meanwhile
