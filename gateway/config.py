"""The gateway's typed configuration; the CLI builds it, core code never reads the environment."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gateway import __version__


@dataclass(frozen=True)
class GatewayConfig:
    api_key: str | None = (
        None  # Bearer or x-api-key; None = open (loopback only, enforced by mesh up)
    )
    max_body_bytes: int = 8 * 1024 * 1024
    max_in_flight: int = 64
    keepalive_s: float = 15.0
    header_wait_s: float = 2.0
    retry_backoff_ms: int = 750
    version: str = __version__
    request_log: Path | None = None
