"""Where a model copy stands: the progress record the copy updates and its sinks draw."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class CopyProgress:
    """Where a copy stands (what the CLI and the console draw)."""

    name: str
    total_bytes: int = 0
    done_bytes: int = 0  # verified and written, including what a resumed copy found on disk
    resumed_bytes: int = 0
    by_source: dict[str, int] = field(default_factory=dict)  # node id → bytes it sent
    dropped: dict[str, str] = field(default_factory=dict)  # node id → why it was dropped
    started_at: float = field(default_factory=time.monotonic)


ProgressSink = Callable[[CopyProgress], None]
