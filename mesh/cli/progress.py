"""Progress bars on the terminal: a :class:`~worker.convert.progress.Progress` sink drawn by rich.

The worker's pull and convert code reports stages and amounts to a sink; only the CLI draws them.
"""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text


class _AmountColumn(ProgressColumn):
    """Bytes for byte-sized stages (download, extract), ``n/total`` for the others."""

    def __init__(self) -> None:
        super().__init__()
        self._bytes = DownloadColumn()
        self._count = MofNCompleteColumn()

    def render(self, task: Task) -> Text:
        column = self._bytes if task.fields.get("in_bytes") else self._count
        return column.render(task)


class RichProgress:
    """A :class:`~worker.convert.progress.Progress` drawn as rich progress bars, one per stage."""

    def __init__(self, console: Console | None = None) -> None:
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            _AmountColumn(),
            TimeRemainingColumn(),
            console=console,
        )

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._finish()
        self._progress.stop()

    def stage(self, description: str, total: int | None = None, in_bytes: bool = False) -> None:
        current = self._current()
        if current is not None and current.description == description and not current.completed:
            # The same stage learned its size (pip prints it once the download starts).
            self._progress.update(current.id, total=total, in_bytes=in_bytes)
            return
        self._finish()
        self._progress.add_task(description, total=total, in_bytes=in_bytes)

    def advance(self, units: int = 1) -> None:
        task = self._current()
        if task is not None:
            self._progress.advance(task.id, units)

    def _current(self) -> Task | None:
        return self._progress.tasks[-1] if self._progress.tasks else None

    def _finish(self) -> None:
        task = self._current()
        if task is None or task.finished:
            return
        # Stages without a size show as a complete bar once the next one starts.
        total = task.total if task.total is not None else 1
        self._progress.update(task.id, total=total, completed=total)


class CopyBars:
    """A peer copy drawn from the node's progress events: one bar with bytes, rate, ETA and
    the peers it comes from (a dropped peer shows as ``✗``)."""

    def __init__(self, console: Console | None = None) -> None:
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[sources]}"),
            console=console,
        )
        self._task: TaskID | None = None

    def __enter__(self) -> CopyBars:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, event: dict) -> None:
        """Draw one ``{"type": "progress", ...}`` event."""
        dropped = event.get("dropped", {})
        sources = ", ".join(
            f"{node[:8]}{' ✗' if node in dropped else ''}"
            for node in {**event.get("by_source", {}), **dropped}
        )
        fields = {"total": event.get("total"), "completed": event.get("done", 0)}
        if self._task is None:
            name = f"copy {event.get('name', '')} from peers"
            self._task = self._progress.add_task(name, sources=f"from {sources}", **fields)
        else:
            self._progress.update(self._task, sources=f"from {sources}", **fields)
