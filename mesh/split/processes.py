"""Rank processes: start a follower rank as a child of this node, stop one, pick ring ports.

Shared by the head's group (mesh/split/ranks.py) and a member's rank host (mesh/split/host.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

from mesh.children import child_preexec, forward_output


async def spawn_rank(
    python: str,
    model_dir: Path,
    split: list[int],
    rank: int,
    hostfile: Path,
    *,
    label: str,
) -> tuple[asyncio.subprocess.Process, asyncio.Task[None]]:
    """Start one follower rank (``python -m worker.serve.split_rank``) as a child that dies with
    this node, and the task that logs its output."""
    command = [
        python, "-m", "worker.serve.split_rank",
        "--model", str(model_dir), "--split", ",".join(map(str, split)),
    ]  # fmt: skip
    env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
    process = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.PIPE,  # a dozing rank waits on it for a wake byte
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        start_new_session=True,
        preexec_fn=child_preexec(),
    )
    assert process.stdout is not None
    return process, asyncio.create_task(forward_output(process.stdout, label))


def wake(process: asyncio.subprocess.Process) -> None:
    """Wake a dozing rank (worker/serve/split_rank.py: it blocks on stdin between requests)."""
    if process.stdin is not None and process.returncode is None:
        with contextlib.suppress(OSError, RuntimeError):
            process.stdin.write(b"w")


async def stop_process(process: asyncio.subprocess.Process) -> None:
    """SIGKILL (which also ends a stopped, SIGSTOP-ed, rank) and reap."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
