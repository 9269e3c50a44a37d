"""A worker's malloc settings: taken on glibc, skipped when turned off or elsewhere."""

from __future__ import annotations

import ctypes
import sys

import pytest

from worker.cpu.allocator import MALLOC_ENV, return_freed_memory


def test_off_leaves_malloc_alone():
    assert return_freed_memory({MALLOC_ENV: "off"}) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_glibc_takes_the_settings():
    try:
        ctypes.CDLL("libc.so.6").gnu_get_libc_version  # noqa: B018 - is this glibc?
    except (OSError, AttributeError):
        pytest.skip("not glibc")
    assert return_freed_memory({}) is True
