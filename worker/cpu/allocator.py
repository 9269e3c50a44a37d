"""Give freed memory back to the system (glibc): the memory budget counts what a worker holds,
and the process must not hold much more.

On the Linux CPU backend MLX allocates its arrays with ``malloc`` and frees them at once (its
buffer cache stays empty). glibc keeps what was freed: in per-thread arenas (up to 8 per core)
and at the top of each heap until it passes a 128 KiB trim threshold that grows with every
large free (the dynamic mmap threshold). The lab's memory replay (bench/results/routing-memory.md)
saw a worker's RSS end within a few MiB of its peak, 6-14 MiB over budget + weights + idle +
64 MiB on 5 runs of 6, all of it in the worker; with two arenas and fixed 128 KiB mmap and trim
thresholds every run stayed under. So a worker sets those at start, before its threads make
arenas (``MLX_MESH_MALLOC=off`` leaves glibc's defaults). Not glibc (macOS, musl): nothing.

The cost: an allocation of 128 KiB or more is a fresh ``mmap`` and its pages are faulted in
again each time; measured on SmolLM2 here (bench/results/cpu.md, "allocator"), within noise.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

MALLOC_ENV = "MLX_MESH_MALLOC"
# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
SETTINGS = ((M_ARENA_MAX, 2), (M_MMAP_THRESHOLD, 128 << 10), (M_TRIM_THRESHOLD, 128 << 10))


def return_freed_memory(env: dict[str, str] | None = None) -> bool:
    """Set glibc's malloc to hand freed memory back (see above); whether it did."""
    env = dict(os.environ) if env is None else env
    if env.get(MALLOC_ENV, "").strip().lower() in ("off", "0", "no", "false"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    done = all(mallopt(param, value) == 1 for param, value in SETTINGS)
    if not done:
        log.warning("malloc settings not taken: a worker may hold freed memory")
    return done
