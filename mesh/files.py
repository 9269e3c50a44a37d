"""Files in the node's home: secrets written 0600, the rest never wider than 0644/0755.

Every file is written atomically (a temporary file, then a rename), so a reader – or a node
killed halfway – never sees half a file; modes are set explicitly, whatever the umask says.
Both the file and its directory are fsynced before the write returns: the member list is
saved before a newcomer is welcomed, and a power cut must not undo what the mesh was told.
"""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_FILE = 0o600  # keys, the mesh secret, members, node.json (it may hold the API key)
PUBLIC_FILE = 0o644  # the certificate: anyone may read it, only we may change it
HOME_DIR = 0o700  # the home holds secrets: nobody else lists it


def make_home(path: Path) -> None:
    """Create the home directory (and parents) 0700; tighten an existing one wider than 0755."""
    path.mkdir(parents=True, exist_ok=True)
    if path.stat().st_mode & 0o022:  # writable by others: never right for a home with secrets
        os.chmod(path, HOME_DIR)


def write_private(path: Path, data: bytes) -> None:
    """Write ``path`` atomically, mode 0600 from the first byte (no world-readable window)."""
    _write(path, data, PRIVATE_FILE)


def write_public(path: Path, data: bytes) -> None:
    """Write ``path`` atomically, mode 0644 whatever the umask."""
    _write(path, data, PUBLIC_FILE)


def _write(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())  # the bytes on disk before the name points at them
    os.chmod(tmp, mode)  # os.open's mode is filtered by the umask; chmod is not
    os.replace(tmp, path)
    _fsync_directory(path.parent)  # and the rename itself


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
