"""The on-disk side of a model copy: the partial directory, what a resumed copy finds there
still valid, the verified writes, and the one rename that puts a finished model in the store.

A copy writes into ``<home>/models/.partial/<name>/files/`` (never listed or loaded), next to
the ``manifest.json`` it was made for: a later fetch of the same manifest re-hashes what is
there and fetches only what is missing; one for another manifest starts afresh. A file is
exactly the concatenation of its chunks, so when every chunk verified the file is the bytes the
manifest names (:func:`seal` checks that, without hashing a second time).
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
from collections import Counter
from pathlib import Path

from mesh.copy.manifest import Chunk, ModelManifest, iter_chunks, verify_chunk
from mesh.copy.progress import CopyProgress
from mesh.errors import ChunkMismatch, CopyError, DiskFull
from worker.store import models_dir

PARTIAL_DIR = ".partial"
_MiB = 1024 * 1024


def partial_dir(home: Path, name: str) -> Path:
    return models_dir(home) / PARTIAL_DIR / name


class PartialFiles:
    """The partial files of one copy, written by the connections' threads.

    Counts the chunks each file still lacks: the thread that writes a file's last chunk syncs
    it to disk, so the fsyncs overlap the transfer of the other files. :meth:`close` stops all
    writing: a connection's thread can outlive its cancelled task by one block, and its
    not-yet-verified bytes must not land after a later pull of the same model checked them."""

    def __init__(self, root: Path, progress: CopyProgress) -> None:
        self.root = root
        self.progress = progress
        self.unwritten: Counter[str] = Counter()
        self.synced: set[str] = set()
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """No write starts after this returns, and none is under way (waits for one block)."""
        with self._write_lock:
            self._closed = True

    def open(self, chunk: Chunk) -> int:
        return os.open(self.root / chunk.path, os.O_WRONLY)

    def write(self, fd: int, data: memoryview, offset: int) -> None:
        with self._write_lock:
            if self._closed:
                raise CopyError(f"the copy of {self.progress.name} was stopped")
            try:
                done = 0
                while done < len(data):  # pwrite may write less than asked
                    done += os.pwrite(fd, data[done:], offset + done)
            except OSError as exc:
                raise self._full(exc) from None

    def written(self, chunk: Chunk, fd: int) -> None:
        """``chunk`` is in its file and verified; sync the file if that was its last."""
        with self._lock:
            self.unwritten[chunk.path] -= 1
            last = self.unwritten[chunk.path] == 0
        if last:
            try:
                os.fsync(fd)
            except OSError as exc:
                raise self._full(exc) from None
            self.synced.add(chunk.path)

    def _full(self, exc: OSError) -> OSError | DiskFull:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            return exc
        p = self.progress
        return DiskFull(
            f"the disk filled up while copying {p.name} ({p.done_bytes / _MiB:.0f} of "
            f"{p.total_bytes / _MiB:.0f} MiB kept; free space and pull again to resume)"
        )


def prepare(
    home: Path, manifest: ModelManifest, files: PartialFiles
) -> tuple[list[Chunk], set[tuple[str, int]]]:
    """Create/size the partial files: (every chunk not already there and valid, in order; the
    (path, chunk index) of those that are). ``DiskFull`` when what is missing does not fit."""
    root, progress = files.root, files.progress
    pending: list[Chunk] = []
    verified: set[tuple[str, int]] = set()
    for entry in manifest.files:
        path = root / entry.path
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with open(path, "ab") as fh:
            fh.truncate(entry.size)
        if not existed:
            pending.extend(c for c in iter_chunks(_only(manifest, entry.path)))
            continue
        with open(path, "rb") as fh:
            for chunk in iter_chunks(_only(manifest, entry.path)):
                data = os.pread(fh.fileno(), chunk.length, chunk.offset)
                try:
                    verify_chunk(chunk, data)
                except ChunkMismatch:
                    pending.append(chunk)
                else:
                    verified.add((chunk.path, chunk.index))
                    progress.resumed_bytes += chunk.length
    progress.done_bytes = progress.resumed_bytes
    files.unwritten.update(c.path for c in pending)
    need = sum(c.length for c in pending)
    free = shutil.disk_usage(root).free
    if need > free:
        raise DiskFull(
            f"not enough disk space for {manifest.name}: {need / _MiB:.0f} MiB more "
            f"needed, {free / _MiB:.0f} MiB free in {models_dir(home)}"
        )
    return pending, verified


def seal(manifest: ModelManifest, files: PartialFiles, verified: set[tuple[str, int]]) -> None:
    """Check that every chunk of every file verified, and that every file is on disk.

    A file is the concatenation of its chunks, so this is the whole-file check without
    reading or hashing the bytes again (see the module docstring)."""
    missing = [c for c in iter_chunks(manifest) if (c.path, c.index) not in verified]
    if missing:  # the copy raises first when chunks are left; this guards the guarantee itself
        raise CopyError(
            f"{len(missing)} chunks of {manifest.name} were never verified "
            f"(first: {missing[0].path} chunk {missing[0].index}); nothing was stored"
        )
    for entry in manifest.files:
        if entry.path in files.synced:
            continue  # synced after its last chunk
        fd = os.open(files.root / entry.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _only(manifest: ModelManifest, path: str) -> ModelManifest:
    return manifest.subset([path])


def reset_if_stale(home: Path, manifest: ModelManifest) -> None:
    """Keep a partial copy only if it was made for exactly this manifest."""
    root = partial_dir(home, manifest.name)
    record = root / "manifest.json"
    try:
        same = record.read_text(encoding="utf-8") == manifest.model_dump_json()
    except OSError:
        same = False
    if not same:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        record.write_text(manifest.model_dump_json(), encoding="utf-8")


def install(home: Path, manifest: ModelManifest, target: Path) -> Path:
    root = partial_dir(home, manifest.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        (root / "files").rename(target)
    except OSError:
        if not target.is_dir():  # not a race with another pull that got there first
            raise
    shutil.rmtree(root, ignore_errors=True)
    return target
