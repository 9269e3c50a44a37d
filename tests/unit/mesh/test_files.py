"""Atomic writes in the node's home: the file and then its directory reach the disk (fsync)
before the write returns, so a power cut cannot undo a member list a newcomer was told."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from mesh import files


def test_a_write_fsyncs_the_file_then_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[tuple[str, bool]] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        mode = os.fstat(fd).st_mode
        target = tmp_path / "members.json"
        # Which one: the directory, or the file (still under its temporary name, or renamed).
        synced.append(("dir" if stat.S_ISDIR(mode) else "file", target.exists()))
        real_fsync(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    files.write_private(tmp_path / "members.json", b"{}")
    # The file's bytes before the rename, the directory (the rename) after it.
    assert synced == [("file", False), ("dir", True)]
    assert (tmp_path / "members.json").read_bytes() == b"{}"
    assert stat.S_IMODE((tmp_path / "members.json").stat().st_mode) == 0o600
    assert not (tmp_path / "members.json.tmp").exists()
