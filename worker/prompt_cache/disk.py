"""The prompt cache's disk tier: KV caches kept on disk across restarts, under a byte bound.

The memory tier (worker/prompt_cache/store.py) writes an entry here when it evicts it, and (at a
bounded rate) when it stores a long one, so a node stopped by SIGKILL still finds its recent
prefixes; on shutdown it writes what it holds. A lookup that misses memory but finds a longer
prefix here loads it back instead of prefilling: reading a 3,000-token SmolLM2 cache (~140 MB in
float32) takes a fraction of a second, prefilling it ~25 s on the Linux CPU.

One entry is two files in ``<home>/cache/<model>/``: ``<key>.safetensors`` (mlx-lm's own
``save_prompt_cache`` format) and ``<key>.json``, written after it, which holds the format
version, the model's fingerprint, the tokens, the byte size and the SHA-256 of the safetensors
file. The directory is read at start; an entry with no or an unreadable sidecar, another format
version, another model's fingerprint or (when loaded) a checksum that does not match is skipped
with one log line and removed – never a crash, never a wrong token. Least recently used goes
first when the bound is passed (a hit touches the sidecar's mtime, so the order survives
restarts).

On the engine's owner thread only (MLX arrays are written and read there).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.prompt_cache.digest import DEFAULT_BLOCK_SIZE, block_hashes, common_prefix

log = logging.getLogger(__name__)

FORMAT = 1
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
        self._last_hot_write = 0.0
        self._written: set[str] = set()
        self._scan()

    # ---- the index ---------------------------------------------------------------------------

    def _scan(self) -> None:
        for sidecar in sorted(self.root.glob("*.json")):
            entry = self._read_sidecar(sidecar)
            if entry is not None:
                self._entries[entry.key] = entry
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

    def _remove(self, key: str) -> None:
        self._entries.pop(key, None)
        for path in (self._sidecar(key), self._data(key)):
            with contextlib.suppress(OSError):
                path.unlink()

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, tokens: Sequence[int]) -> bool:
        return tokens_key(tokens) in self._entries

    def chains(self) -> list[list[int]]:
        """Each entry's block hashes, most recently used first (for the digest)."""
        ordered = sorted(self._entries.values(), key=lambda e: e.used, reverse=True)
        return [e.chain for e in ordered]

    # ---- writes ------------------------------------------------------------------------------

    def worth_keeping(self, tokens: Sequence[int], cache: list[Any]) -> bool:
        """Long enough to be worth a file, not on disk yet, and plain KV layers (mlx-lm's file
        format keeps a sliding window's arrays but not its position: such models keep their
        caches in memory only)."""
        from mlx_lm.models.cache import KVCache

        return (
            len(tokens) >= self.config.min_tokens
            and tokens not in self
            and all(type(c) is KVCache for c in cache)
        )

    def forget_written(self) -> None:
        """Remove what this process wrote (the start-up warm-up's prompts are no user's)."""
        for key in list(self._written):
            self._remove(key)
        self._written.clear()

    def hot_write_due(self, now: float | None = None) -> bool:
        """Whether a hot (still in memory) entry may be written now: one every
        ``hot_interval_s``, so a busy node does not spend its owner thread writing."""
        now = time.monotonic() if now is None else now
        return now - self._last_hot_write >= self.config.hot_interval_s

    def save(self, tokens: Sequence[int], cache: list[Any], *, hot: bool = False) -> bool:
        """Write ``cache`` (holding exactly ``tokens``); whether it was written."""
        from mlx_lm.models.cache import save_prompt_cache

        if not self.worth_keeping(tokens, cache):
            return False
        if hot:
            self._last_hot_write = time.monotonic()
        key = tokens_key(tokens)
        data, sidecar = self._data(key), self._sidecar(key)
        # Written under another name, then renamed: a write cut short leaves a file the next
        # start finds undescribed and removes. (mx.save_safetensors wants the suffix.)
        target = self.root / f"{key}.partial.safetensors"
        try:
            save_prompt_cache(str(target), cache, {"mlx_mesh_format": str(FORMAT)})
            os.replace(target, data)
            nbytes = data.stat().st_size
            meta = {
                "format": FORMAT,
                "model": self.config.fingerprint,
                "tokens": list(tokens),
                "nbytes": nbytes,
                "sha256": _file_sha256(data),
                "saved_at": time.time(),
            }
            written = sidecar.with_suffix(".json.tmp")
            written.write_text(json.dumps(meta))
            os.replace(written, sidecar)
        except (OSError, ValueError) as exc:
            log.warning("prompt cache on disk: could not write %d tokens: %s", len(tokens), exc)
            self._remove(key)
            return False
        tokens = tuple(tokens)
        self._entries[key] = DiskEntry(
            key, tokens, nbytes, meta["sha256"], time.time(), block_hashes(tokens, self.block_size)
        )
        self._written.add(key)
        self.stats.writes += 1
        self._bound()
        return True

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
        best, best_len = None, 0
        for entry in self._entries.values():
            n = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
            if n > best_len:
                best, best_len = entry, n
        return best, best_len

    def load(self, entry: DiskEntry) -> list[Any] | None:
        """The cache ``entry`` holds, or None (with one log line, the files removed) when its
        file no longer matches what was written."""
        from mlx_lm.models.cache import load_prompt_cache

        data = self._data(entry.key)
        try:
            if _file_sha256(data) != entry.sha256:
                return self._skip(entry.key, "checksum mismatch (a corrupt or truncated file)")
            cache, meta = load_prompt_cache(str(data), return_metadata=True)
            if meta.get("mlx_mesh_format") != str(FORMAT):
                return self._skip(entry.key, "written by another format")
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            return self._skip(entry.key, f"unreadable: {exc}")
        entry.used = time.time()
        with contextlib.suppress(OSError):
            os.utime(self._sidecar(entry.key))
        self.stats.loads += 1
        loaded: list[Any] = cache
        return loaded

    def as_dict(self) -> dict[str, Any]:
        return {
            "entries": len(self._entries),
            "bytes": self.nbytes,
            "max_bytes": self.config.max_bytes,
            "writes": self.stats.writes,
            "loads": self.stats.loads,
            "skipped": self.stats.skipped,
            "evictions": self.stats.evictions,
        }
