"""Reconnecting to a peer: exponential backoff with full jitter.

``backoff_delays`` is the pure schedule (seedable, tested without sleeping);
``connect_with_retry`` dials through a ``TunnelEndpoint`` until it succeeds, a permanent error
(pin mismatch, duplicate node) stops it, or the attempts run out::

    conn = await connect_with_retry(endpoint, host, port, expected_node_id=peer_id, attempts=5)
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING

from mesh.errors import AuthFailed, ConnectError, DuplicateNodeError

if TYPE_CHECKING:
    from mesh.tunnel import PeerConnection, TunnelEndpoint

log = logging.getLogger(__name__)


def backoff_delays(
    base: float = 0.25, cap: float = 10.0, rng: random.Random | None = None
) -> Iterator[float]:
    """Endless delays: attempt n waits uniform(0, min(cap, base * 2**n)) ("full jitter"), so
    many nodes reconnecting after a partition do not dial in lockstep."""
    rng = rng or random.Random()
    attempt = 0
    while True:
        yield rng.uniform(0, min(cap, base * 2**attempt))
        attempt = min(attempt + 1, 62)


async def connect_with_retry(
    endpoint: TunnelEndpoint,
    host: str,
    port: int,
    *,
    expected_fingerprint: str | None = None,
    expected_node_id: str | None = None,
    attempts: int | None = None,
    base: float = 0.25,
    cap: float = 10.0,
    rng: random.Random | None = None,
) -> PeerConnection:
    """Dial until connected. ``attempts=None`` retries forever (cancel the task to stop).
    ``AuthFailed`` and ``DuplicateNodeError`` are permanent and raised at once; after the last
    attempt the last ``ConnectError`` is raised."""
    delays = backoff_delays(base, cap, rng)
    tried = 0
    while True:
        tried += 1
        try:
            return await endpoint.connect(
                host,
                port,
                expected_fingerprint=expected_fingerprint,
                expected_node_id=expected_node_id,
            )
        except (AuthFailed, DuplicateNodeError):
            raise
        except ConnectError as exc:
            if attempts is not None and tried >= attempts:
                raise
            delay = next(delays)
            log.info("dial %s:%d failed (%s); retry in %.2fs", host, port, exc, delay)
            await asyncio.sleep(delay)
