"""The prompt cache's disk tier: KV caches kept on disk across restarts, under a byte bound.

The memory tier (worker/prompt_cache/store.py) writes an entry here when it evicts it, and (at a
bounded rate) when it stores a long one, so a node stopped by SIGKILL still finds its recent
prefixes; on shutdown it writes what it holds. A lookup that misses memory but finds a longer
prefix here loads it back instead of prefilling: reading a 3,000-token SmolLM2 cache (~140 MB in
float32) takes a fraction of a second, prefilling it ~25 s on the Linux CPU.

One entry is two files in ``<home>/cache/<model>/``: ``<key>.safetensors`` (each layer's keys and
values, cut to the tokens they hold) and ``<key>.json``, written after it, which holds the format
version, the model's fingerprint, the tokens, the byte size and the SHA-256 of the safetensors
file. The owner thread only copies the arrays out (a memcpy); a writer thread writes and hashes
the files, so a commit never holds the next turn behind a disk write (measured: a 1,000-token
prefix's write after turn 1 added ~0.3 s to turn 2's first token when it ran on the owner
thread). The directory is read at start; an entry with no or an unreadable sidecar, another format
version, another model's fingerprint or (when loaded) a checksum that does not match is skipped
with one log line and removed – never a crash, never a wrong token. Least recently used goes
first when the bound is passed (a hit touches the sidecar's mtime, so the order survives
restarts).

The index and MLX arrays live on the engine's owner thread; the writer thread sees numpy
copies and hands finished entries back through a queue the owner thread drains.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.prompt_cache.digest import DEFAULT_BLOCK_SIZE, block_hashes, common_prefix

log = logging.getLogger(__name__)

FORMAT = 2  # 1: mlx-lm's save_prompt_cache files (written on the owner thread)
MAX_QUEUED_WRITES = 4  # past this, a write is dropped (counted): memory is the bound here
DEFAULT_MIN_TOKENS = 256  # shorter prefixes prefill in about a second: not worth a file
DEFAULT_HOT_INTERVAL_S = 5.0  # at most one write of a hot (not evicted) entry this often


@dataclass(frozen=True, slots=True)
class DiskTierConfig:
    """Where the disk tier lives, its bound, and whose caches it holds (``fingerprint``: the
    model's, see :func:`model_fingerprint`)."""

    directory: str
    max_bytes: int
    fingerprint: str
    min_tokens: int = DEFAULT_MIN_TOKENS
    hot_interval_s: float = DEFAULT_HOT_INTERVAL_S


@dataclass
class DiskEntry:
    key: str
    tokens: tuple[int, ...]
    nbytes: int
    sha256: str
    used: float  # last use (the sidecar's mtime)
    chain: list[int] = field(default_factory=list)


@dataclass
class DiskStats:
    writes: int = 0
    loads: int = 0
    skipped: int = 0  # files found unusable (corrupt, truncated, foreign)
    evictions: int = 0
    dropped: int = 0  # writes given up because the writer was behind


def model_fingerprint(model_path: str) -> str:
    """What tells one model's caches from another's: its config and its weight files' names and
    sizes (a re-converted model under the same name gets a new fingerprint)."""
    path = Path(model_path)
    digest = hashlib.sha256()
    config = path / "config.json"
    digest.update(config.read_bytes() if config.is_file() else model_path.encode())
    for weights in sorted(path.glob("*.safetensors")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return digest.hexdigest()[:32]


def tokens_key(tokens: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()[:32]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


class DiskTier:
    """The entries on disk (an index read at start), written and loaded on demand."""

    def __init__(self, config: DiskTierConfig, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.config = config
        self.root = Path(config.directory)
        self.root.mkdir(parents=True, exist_ok=True)
        self.block_size = block_size
        self.stats = DiskStats()
        self._entries: dict[str, DiskEntry] = {}
        self._nbytes = 0  # the entries' bytes, kept as they come and go (/health reads it)
        self._last_hot_write = 0.0
        self._written: set[str] = set()
        self._queued: set[str] = set()  # keys on their way to disk
        self._writes: queue.Queue[tuple[str, tuple[int, ...], dict[str, Any], str]] = queue.Queue()
        self._done: queue.Queue[tuple[str, DiskEntry | None, str]] = queue.Queue()
        self._writer: threading.Thread | None = None
        # The last loads' (tokens, seconds): what a restore costs, for routing to weigh.
        self._restores: deque[tuple[int, float]] = deque(maxlen=8)
        self._scan()

    # ---- the index ---------------------------------------------------------------------------

    def _scan(self) -> None:
        for sidecar in sorted(self.root.glob("*.json")):
            entry = self._read_sidecar(sidecar)
            if entry is not None:
                self._add(entry)
        for data in self.root.glob("*.safetensors"):
            if data.stem not in self._entries:  # written, never described: a write cut short
                self._skip(data.stem, "no description (a write cut short)")
        for partial in self.root.glob("*.tmp"):
            partial.unlink(missing_ok=True)
        self._bound()

    def _read_sidecar(self, sidecar: Path) -> DiskEntry | None:
        key = sidecar.stem
        try:
            meta = json.loads(sidecar.read_text())
            if meta.get("format") != FORMAT:
                return self._skip(key, f"format {meta.get('format')!r}, this worker reads {FORMAT}")
            if meta.get("model") != self.config.fingerprint:
                return self._skip(key, "another model's cache")
            tokens = tuple(int(t) for t in meta["tokens"])
            data = self._data(key)
            if not data.is_file():
                return self._skip(key, "its cache file is missing")
            return DiskEntry(
                key,
                tokens,
                int(meta["nbytes"]),
                str(meta["sha256"]),
                sidecar.stat().st_mtime,
                block_hashes(tokens, self.block_size),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return self._skip(key, f"unreadable description: {exc}")

    def _skip(self, key: str, why: str) -> None:
        log.warning("prompt cache on disk: skipped %s: %s", key, why)
        self.stats.skipped += 1
        self._remove(key)
        return None

    def _data(self, key: str) -> Path:
        return self.root / f"{key}.safetensors"

    def _sidecar(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def _add(self, entry: DiskEntry) -> None:
        self._entries[entry.key] = entry
        self._nbytes += entry.nbytes

    def _remove(self, key: str) -> None:
        if (entry := self._entries.pop(key, None)) is not None:
            self._nbytes -= entry.nbytes
        for path in (self._sidecar(key), self._data(key)):
            with contextlib.suppress(OSError):
                path.unlink()

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> set[str]:
        """The keys of the entries on disk and on their way there (owner thread)."""
        return set(self._entries) | self._queued

    def __contains__(self, tokens: Sequence[int]) -> bool:
        key = tokens_key(tokens)
        return key in self._entries or key in self._queued

    def chains(self) -> list[list[int]]:
        """Each entry's block hashes, most recently used first (for the digest)."""
        self._collect()
        ordered = sorted(self._entries.values(), key=lambda e: e.used, reverse=True)
        return [e.chain for e in ordered]

    # ---- writes ------------------------------------------------------------------------------

    def worth_keeping(self, tokens: Sequence[int], cache: list[Any]) -> bool:
        """Long enough to be worth a file, not on disk yet, and plain KV layers (a file holds
        each layer's keys and values, not a sliding window's position: such models keep their
        caches in memory only)."""
        from mlx_lm.models.cache import KVCache

        return (
            len(tokens) >= self.config.min_tokens
            and tokens not in self
            and all(type(c) is KVCache for c in cache)
        )

    def forget_written(self) -> None:
        """Remove what this process wrote (the start-up warm-up's prompts are no user's)."""
        self.flush()
        for key in list(self._written):
            self._remove(key)
        self._written.clear()

    def save(self, tokens: Sequence[int], cache: list[Any], *, hot: bool = False) -> bool:
        """Queue ``cache`` (holding exactly ``tokens``) for the writer; whether it was queued.
        The arrays are copied out here (on the owner thread), cut to the tokens they hold. A
        ``hot`` entry (still in memory) goes at most once every ``hot_interval_s``: its copy
        and its write are not free, and an evicted one will follow anyway."""
        import mlx.core as mx
        import numpy as np

        if hot and time.monotonic() - self._last_hot_write < self.config.hot_interval_s:
            return False
        self._collect()
        if not self.worth_keeping(tokens, cache):
            return False
        if self._writes.qsize() >= MAX_QUEUED_WRITES:
            self.stats.dropped += 1
            return False
        if hot:
            self._last_hot_write = time.monotonic()
        tensors: dict[str, Any] = {}
        dtype = ""
        for i, layer in enumerate(cache):
            for name, array in (("keys", layer.keys), ("values", layer.values)):
                held = array[..., : layer.offset, :]
                dtype = str(held.dtype).removeprefix("mlx.core.")
                if dtype == "bfloat16":  # numpy has none: its bits travel as uint16
                    held = held.view(mx.uint16)
                tensors[f"{i}.{name}"] = np.array(held)
        key = tokens_key(tokens)
        self._queued.add(key)
        self._writes.put((key, tuple(tokens), tensors, dtype))
        self._ensure_writer()
        return True

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait until the writer has written what was queued (shutdown, tests)."""
        deadline = time.monotonic() + timeout_s
        while self._queued and time.monotonic() < deadline:
            self._collect()
            time.sleep(0.01)
        self._collect()

    def _ensure_writer(self) -> None:
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_loop, name="kv-disk", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        while True:
            key, tokens, tensors, dtype = self._writes.get()
            self._done.put(self._write(key, tokens, tensors, dtype))

    def _write(
        self, key: str, tokens: tuple[int, ...], tensors: dict[str, Any], dtype: str
    ) -> tuple[str, DiskEntry | None, str]:
        """On the writer thread: the files of one entry; (key, entry or None, why not)."""
        from safetensors.numpy import save_file

        data, sidecar = self._data(key), self._sidecar(key)
        # Written under another name, then renamed: a write cut short leaves a file the next
        # start finds undescribed and removes.
        partial = self.root / f"{key}.partial.safetensors"
        try:
            save_file(tensors, str(partial), metadata={"format": str(FORMAT), "dtype": dtype})
            os.replace(partial, data)
            nbytes = data.stat().st_size
            digest = _file_sha256(data)
            meta = {
                "format": FORMAT,
                "model": self.config.fingerprint,
                "tokens": list(tokens),
                "nbytes": nbytes,
                "sha256": digest,
                "saved_at": time.time(),
            }
            written = sidecar.with_suffix(".json.tmp")
            written.write_text(json.dumps(meta))
            os.replace(written, sidecar)
        except (OSError, ValueError) as exc:
            for path in (partial, data, sidecar):
                with contextlib.suppress(OSError):
                    path.unlink()
            return key, None, str(exc)
        entry = DiskEntry(key, tokens, nbytes, digest, time.time())
        self.stats.writes += 1  # only this thread counts writes: /health reads it as it goes
        return key, entry, ""

    def _collect(self) -> None:
        """Take in what the writer finished (owner thread)."""
        while True:
            try:
                key, entry, why = self._done.get_nowait()
            except queue.Empty:
                return
            self._queued.discard(key)
            if entry is None:
                log.warning("prompt cache on disk: could not write %s: %s", key, why)
                continue
            entry.chain = block_hashes(entry.tokens, self.block_size)
            self._add(entry)
            self._written.add(key)
            self._bound()

    def _bound(self) -> None:
        total = self.nbytes
        for entry in sorted(self._entries.values(), key=lambda e: e.used):
            if total <= self.config.max_bytes:
                break
            total -= entry.nbytes
            self._remove(entry.key)
            self.stats.evictions += 1

    # ---- reads -------------------------------------------------------------------------------

    def best(self, prompt: Sequence[int]) -> tuple[DiskEntry | None, int]:
        """The entry sharing the longest prefix with ``prompt`` (at least one prompt token
        left to run) and that length. Disk caches are plain KV caches: a longer entry is
        trimmed back after loading."""
        self._collect()
        best, best_len = None, 0
        for entry in self._entries.values():
            n = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
            if n > best_len:
                best, best_len = entry, n
        return best, best_len

    def load(self, entry: DiskEntry) -> list[Any] | None:
        """The cache ``entry`` holds, or None (with one log line, the files removed) when its
        file no longer matches what was written."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache

        data = self._data(entry.key)
        started = time.monotonic()
        try:
            if _file_sha256(data) != entry.sha256:
                return self._skip(entry.key, "checksum mismatch (a corrupt or truncated file)")
            arrays, meta = mx.load(str(data), return_metadata=True)
            if meta.get("format") != str(FORMAT):
                return self._skip(entry.key, "written by another format")
            cache = []
            for i in range(len(arrays) // 2):
                keys, values = arrays[f"{i}.keys"], arrays[f"{i}.values"]
                if meta.get("dtype") == "bfloat16":
                    keys, values = keys.view(mx.bfloat16), values.view(mx.bfloat16)
                if keys.shape[2] != len(entry.tokens):
                    return self._skip(entry.key, "its arrays do not hold its tokens")
                layer = KVCache()
                layer.state = (keys, values, keys.shape[2])
                cache.append(layer)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            return self._skip(entry.key, f"unreadable: {exc}")
        entry.used = time.time()
        with contextlib.suppress(OSError):
            os.utime(self._sidecar(entry.key))
        self.stats.loads += 1
        self._restores.append((len(entry.tokens), time.monotonic() - started))
        return cache

    def restore_tokens_per_second(self) -> float | None:
        """Tokens restored per second over the last loads (checksum, read and all); None before
        any. Read from any thread: a copy of the deque is taken at once."""
        restores = list(self._restores)
        seconds = sum(s for _, s in restores)
        return sum(n for n, _ in restores) / seconds if seconds > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "entries": len(self._entries),
            "bytes": self.nbytes,
            "max_bytes": self.config.max_bytes,
            "writes": self.stats.writes,
            "loads": self.stats.loads,
            "skipped": self.stats.skipped,
            "evictions": self.stats.evictions,
            "dropped": self.stats.dropped,
            "writing": len(self._queued),
        }
