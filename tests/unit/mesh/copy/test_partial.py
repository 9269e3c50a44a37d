"""The partial files of a copy: writes after close are refused (a connection's thread can
outlive its cancelled task by one block; its unverified bytes must not land after that)."""

from __future__ import annotations

import os

import pytest

from mesh.copy.manifest import Chunk
from mesh.copy.partial import PartialFiles
from mesh.copy.progress import CopyProgress
from mesh.errors import CopyError


def test_no_write_after_close_and_the_last_chunk_syncs(tmp_path):
    (tmp_path / "w").write_bytes(b"\0" * 8)
    files = PartialFiles(tmp_path, CopyProgress(name="m", total_bytes=8))
    files.unwritten.update(["w", "w"])
    first, second = (Chunk("w", i, i * 4, 4, "0" * 64) for i in range(2))
    fd = files.open(first)
    try:
        files.write(fd, memoryview(b"abcd"), 0)
        files.written(first, fd)
        assert files.synced == set()  # one chunk of two: not yet
        files.write(fd, memoryview(b"efgh"), 4)
        files.written(second, fd)
        assert files.synced == {"w"}
        files.close()
        with pytest.raises(CopyError, match="was stopped"):
            files.write(fd, memoryview(b"XXXX"), 0)
    finally:
        os.close(fd)
    assert (tmp_path / "w").read_bytes() == b"abcdefgh"
