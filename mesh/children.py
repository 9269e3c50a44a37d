"""Child processes of a node (workers, split ranks): they die with it and log through it."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable

log = logging.getLogger("mesh.workers")  # children's lines keep the logger they always had


def die_with_parent() -> None:
    """Linux: the child gets SIGTERM if the node dies, even by SIGKILL (no orphans)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def child_preexec() -> Callable[[], None] | None:
    """The ``preexec_fn`` a node's child is spawned with: none off Linux (no PDEATHSIG)."""
    return die_with_parent if sys.platform == "linux" else None


async def forward_output(
    stream: asyncio.StreamReader, name: str, on_line: Callable[[str], bool] | None = None
) -> None:
    """Log a child's output; ``on_line`` may take a line as a message to the node (True)."""
    while line := await stream.readline():
        text = line.decode(errors="replace").rstrip()
        if on_line is not None and on_line(text):
            continue
        log.info("[worker %s] %s", name, text)
