"""Child processes of the fault lab: each in its own process group, always cleaned up.

Every process is started with ``start_new_session=True`` so a node and whatever it spawns (its
worker) can be signalled together, and so a Ctrl-C in the terminal reaches only the lab, which
then tears the nodes down itself. Clean-up runs from ``close()`` (the normal path), from
``atexit`` (exceptions, ``sys.exit``) and from a SIGTERM/SIGHUP handler that turns the signal
into ``SystemExit`` so the same paths run.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


def _parent_map() -> dict[int, list[int]]:
    """ppid → child pids: from /proc on Linux, else from ``ps`` (macOS)."""
    parents: dict[int, list[int]] = {}
    proc = Path("/proc")
    if proc.is_dir():
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # exited while we looked
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses: split after ")"
            ppid = int(stat.rpartition(")")[2].split()[1])
            parents.setdefault(ppid, []).append(int(entry.name))
        return parents
    try:
        listing = subprocess.run(
            ["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return parents
    for line in listing.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
            parents.setdefault(int(fields[1]), []).append(int(fields[0]))
    return parents


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, children first (workers run in their own sessions)."""
    parents = _parent_map()
    found: list[int] = []
    queue = [pid]
    while queue:
        children = parents.get(queue.pop(0), [])
        found += children
        queue += children
    return found


def cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        pass  # no /proc (macOS): ask ps below
    try:
        return subprocess.run(
            ["ps", "-o", "command=", "-p", str(pid)],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def alive(pid: int) -> bool:
    """True for a running or stopped process; False for gone or a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state != "Z"


@dataclass
class ManagedProcess:
    """One child: its own process group (pgid == pid) and a log file."""

    name: str
    argv: list[str]
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def tree(self) -> list[int]:
        """The process and every descendant (the worker it spawned, …)."""
        return [self.pid, *descendants(self.pid)]

    def signal_tree(self, sig: int) -> None:
        """Signal the process group, then any descendant that left it (a new session)."""
        pids = self.tree()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


class ProcessRegistry:
    """Starts processes and guarantees they end: ``close()`` / atexit / SIGTERM."""

    def __init__(self) -> None:
        self.processes: list[ManagedProcess] = []
        self._seen: set[int] = set()  # every pid we started or saw as a descendant
        self._installed = False
        self._previous: dict[int, object] = {}

    def install_cleanup(self) -> None:
        """Register atexit and SIGTERM/SIGHUP handlers (main thread only)."""
        if self._installed:
            return
        self._installed = True
        atexit.register(self.close)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the lab's finally blocks

    def uninstall_cleanup(self) -> None:
        if not self._installed:
            return
        atexit.unregister(self.close)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._installed = False

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> ManagedProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log_file:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
            )
        process = ManagedProcess(name, list(argv), popen, log_path)
        self.processes.append(process)
        self._seen.add(process.pid)
        return process

    def note_descendants(self) -> None:
        """Remember the current descendants, so ``leftovers`` can check them after clean-up."""
        for process in self.processes:
            self._seen.update(process.tree())

    def stop(self, process: ManagedProcess, grace_s: float = 5.0) -> None:
        """SIGCONT (a stopped process cannot exit), SIGTERM, wait, then SIGKILL the tree."""
        self._seen.update(process.tree())
        if not process.running() and not any(alive(p) for p in process.tree()[1:]):
            return
        tree = process.tree()
        process.signal_tree(signal.SIGCONT)
        process.signal_tree(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(alive(p) for p in tree):
            process.popen.poll()
            time.sleep(0.05)
        if any(alive(p) for p in tree):
            log.warning("%s did not exit on SIGTERM within %.1fs: SIGKILL", process.name, grace_s)
            process.signal_tree(signal.SIGKILL)
            for pid in tree:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.popen.wait(timeout=5)

    def close(self, grace_s: float = 5.0) -> None:
        """End every process this registry started (idempotent)."""
        self.note_descendants()
        for process in reversed(self.processes):
            try:
                self.stop(process, grace_s)
            except OSError as exc:  # keep going: the others must still be cleaned up
                print(f"lab: could not stop {process.name}: {exc}", file=sys.stderr)

    def leftovers(self) -> list[int]:
        """Pids we started (or saw as their descendants) that are still alive."""
        for process in self.processes:
            process.popen.poll()
        return sorted(pid for pid in self._seen if alive(pid))
