"""How long-running store operations report progress, without knowing about the terminal."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """Receives progress of one operation: a sequence of stages, each with optional work units."""

    def stage(self, description: str, total: int | None = None) -> None:
        """Start a new stage; ``total`` units of work follow (None: unknown)."""

    def advance(self, units: int = 1) -> None:
        """``units`` more units of the current stage are done."""


class NullProgress:
    """Progress that goes nowhere (library use, tests)."""

    def stage(self, description: str, total: int | None = None) -> None:
        return None

    def advance(self, units: int = 1) -> None:
        return None
