"""What a stored model is, byte for byte: files, sizes, SHA-256 per file and per chunk.

No network and no asyncio: :func:`build_manifest` reads a model directory (call it in a thread
for big models), everything else is pure. A manifest names its files by relative POSIX paths;
:func:`check_manifest` refuses anything a peer could use to write outside the destination
(absolute paths, ``..``, duplicates) and any inconsistency between sizes and chunk lists, so a
tampered manifest fails before a byte is written.

    manifest = build_manifest(model_dir, "smollm2-135m")
    check_manifest(manifest)
    verify_chunk(manifest.file("model.safetensors"), 0, data)   # raises ChunkMismatch
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from pydantic import BaseModel, Field, ValidationError

from mesh.errors import ChunkMismatch, ManifestError

CHUNK_SIZE = 8 * 1024 * 1024
MAX_CHUNK_SIZE = 64 * 1024 * 1024
MANIFEST_VERSION = 1


class FileEntry(BaseModel):
    """One file of a model: its path inside the model dir, size and hashes."""

    path: str
    size: int = Field(ge=0)
    sha256: str
    chunks: list[str] = Field(default_factory=list)  # SHA-256 of each chunk, in order


class ModelManifest(BaseModel):
    """A model's files. Two manifests with the same :meth:`digest` describe the same bytes."""

    version: int = MANIFEST_VERSION
    name: str
    chunk_size: int = CHUNK_SIZE
    files: list[FileEntry]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, path: str) -> FileEntry:
        for entry in self.files:
            if entry.path == path:
                return entry
        raise ManifestError(f"model {self.name!r} has no file {path!r}")

    def digest(self) -> str:
        """SHA-256 of the canonical JSON: what peers compare before mixing their chunks."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()

    def subset(self, paths: Iterable[str] | None) -> ModelManifest:
        """The same manifest limited to ``paths`` (all files when None); unknown ones raise."""
        if paths is None:
            return self
        wanted = list(dict.fromkeys(paths))
        return self.model_copy(update={"files": [self.file(p) for p in wanted]})


@dataclass(frozen=True)
class Chunk:
    """One unit of transfer: ``length`` bytes of ``path`` from ``offset``; ``index`` in its file."""

    path: str
    index: int
    offset: int
    length: int
    sha256: str


def chunk_count(size: int, chunk_size: int) -> int:
    return max(1, -(-size // chunk_size)) if size else 0


def iter_chunks(manifest: ModelManifest) -> Iterator[Chunk]:
    """Every chunk of every file, in file order."""
    step = manifest.chunk_size
    for entry in manifest.files:
        for index, digest in enumerate(entry.chunks):
            offset = index * step
            yield Chunk(entry.path, index, offset, min(step, entry.size - offset), digest)


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def verify_chunk(chunk: Chunk, data: bytes | memoryview) -> None:
    """Raise :class:`ChunkMismatch` unless ``data`` is exactly ``chunk``'s bytes."""
    verify_digest(chunk, len(data), sha256_hex(data))


def verify_digest(chunk: Chunk, length: int, sha256: str) -> None:
    """Raise :class:`ChunkMismatch` unless ``length`` bytes hashing to ``sha256`` (hex) are
    ``chunk``'s: for bytes hashed as they streamed in."""
    if length != chunk.length:
        raise ChunkMismatch(
            f"{chunk.path} chunk {chunk.index}: got {length} bytes, expected {chunk.length}"
        )
    if sha256 != chunk.sha256:
        raise ChunkMismatch(f"{chunk.path} chunk {chunk.index}: SHA-256 does not match")


def check_manifest(manifest: ModelManifest, name: str | None = None) -> None:
    """Raise :class:`ManifestError` for a manifest that is not self-consistent or not safe."""
    if name is not None and manifest.name != name:
        raise ManifestError(f"asked for model {name!r}, the manifest is for {manifest.name!r}")
    if manifest.version != MANIFEST_VERSION:
        raise ManifestError(f"manifest version {manifest.version} is not {MANIFEST_VERSION}")
    if not 0 < manifest.chunk_size <= MAX_CHUNK_SIZE:
        raise ManifestError(f"manifest chunk size {manifest.chunk_size} is out of range")
    if not manifest.files:
        raise ManifestError(f"the manifest of {manifest.name!r} lists no files")
    seen: set[str] = set()
    for entry in manifest.files:
        _check_path(entry.path)
        if entry.path in seen:
            raise ManifestError(f"the manifest lists {entry.path!r} twice")
        seen.add(entry.path)
        if len(entry.chunks) != chunk_count(entry.size, manifest.chunk_size):
            raise ManifestError(
                f"{entry.path}: {len(entry.chunks)} chunk hashes for {entry.size} bytes"
            )
        for digest in [entry.sha256, *entry.chunks]:
            if len(digest) != 64 or digest.strip("0123456789abcdef"):
                raise ManifestError(f"{entry.path}: {digest[:16]!r}… is not a SHA-256 hex")
        _check_file_hash(entry)


EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def _check_file_hash(entry: FileEntry) -> None:
    """Where the file's SHA-256 follows from its chunk list alone, it must (no bytes needed).

    A file of one chunk is that chunk, an empty file is no bytes. For longer files the copy
    does not re-hash the whole file: every chunk is verified on arrival and the file is
    exactly the concatenation of its chunks, so its bytes are the ones the manifest's chunk
    hashes name; the file hash stays in the manifest for ``sha256sum`` comparisons."""
    if len(entry.chunks) > 1:
        return
    expected = entry.chunks[0] if entry.chunks else EMPTY_SHA256
    if entry.sha256 != expected:
        what = "its only chunk" if entry.chunks else "no bytes"
        raise ManifestError(
            f"{entry.path}: the file's SHA-256 is not the hash of {what} (a tampered manifest)"
        )


def _check_path(path: str) -> None:
    pure = PurePosixPath(path)
    if (
        not path
        or pure.is_absolute()
        or "\\" in path
        or any(part in ("", ".", "..") for part in path.split("/"))
        or any(part.startswith(".") for part in pure.parts)
    ):
        raise ManifestError(f"unsafe file path in the manifest: {path!r}")


def manifest_from_json(raw: bytes | str, name: str | None = None) -> ModelManifest:
    """Decode and check a manifest a peer sent; ``ManifestError`` in one sentence otherwise."""
    try:
        manifest = ModelManifest.model_validate_json(raw)
    except ValidationError as exc:
        raise ManifestError(f"not a model manifest: {exc.errors()[0]['msg']}") from None
    check_manifest(manifest, name)
    return manifest


def model_files(model_dir: Path) -> list[str]:
    """Relative POSIX paths of the regular files under ``model_dir``, dot-files skipped."""
    out = []
    for root, dirs, files in os.walk(model_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith("."):
                continue
            full = Path(root) / name
            if full.is_file() and not full.is_symlink():
                out.append(full.relative_to(model_dir).as_posix())
    return out


def hash_file(path: Path, chunk_size: int = CHUNK_SIZE) -> tuple[str, list[str], int]:
    """(whole-file SHA-256, per-chunk SHA-256s, size) in one pass over the file."""
    whole = hashlib.sha256()
    chunks: list[str] = []
    size = 0
    with open(path, "rb") as fh:
        while block := fh.read(chunk_size):
            whole.update(block)
            chunks.append(sha256_hex(block))
            size += len(block)
    return whole.hexdigest(), chunks, size


def build_manifest(model_dir: Path, name: str, chunk_size: int = CHUNK_SIZE) -> ModelManifest:
    """Hash every file of ``model_dir`` (one read pass each): the model's manifest."""
    entries = []
    for rel in model_files(model_dir):
        whole, chunks, size = hash_file(model_dir / rel, chunk_size)
        entries.append(FileEntry(path=rel, size=size, sha256=whole, chunks=chunks))
    if not entries:
        raise ManifestError(f"{model_dir} holds no files")
    return ModelManifest(name=name, chunk_size=chunk_size, files=entries)


def stat_signature(model_dir: Path) -> tuple[tuple[str, int, int], ...]:
    """(path, size, mtime_ns) of every file: a cached manifest is valid while this is unchanged."""
    out = []
    for rel in model_files(model_dir):
        st = (model_dir / rel).stat()
        out.append((rel, st.st_size, st.st_mtime_ns))
    return tuple(out)
