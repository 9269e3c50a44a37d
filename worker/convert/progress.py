"""How long-running store operations report progress, without knowing about the terminal."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """Receives progress of one operation: a sequence of stages, each with optional work units."""

    def stage(self, description: str, total: int | None = None, in_bytes: bool = False) -> None:
        """Start a new stage; ``total`` units (bytes if ``in_bytes``) follow (None: unknown)."""

    def advance(self, units: int = 1) -> None:
        """``units`` more units of the current stage are done."""


class NullProgress:
    """Progress that goes nowhere (library use, tests)."""

    def stage(self, description: str, total: int | None = None, in_bytes: bool = False) -> None:
        return None

    def advance(self, units: int = 1) -> None:
        return None
