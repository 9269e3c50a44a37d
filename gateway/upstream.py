"""The narrow seam between the gateway and whatever serves a model.

An :class:`Upstream` takes a :class:`ChatRequest` and yields internal events ending with exactly
one ``Done`` or ``Error``. The gateway never knows whether that is the local worker (HTTP on
loopback), a peer (QUIC tunnel, in ``mesh``) or a test double (:mod:`gateway.testing`).

A :class:`ModelDirectory` is the read-only view of which models are reachable and how to reach
them. ``mesh`` implements it over its peer table; a one-node gateway uses :class:`StaticDirectory`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from gateway.events import Event
from gateway.request import ChatRequest


@runtime_checkable
class Upstream(Protocol):
    """Something that serves models. ``stream`` must always end with ``Done`` or ``Error``."""

    name: str  # "local" or a peer's node id: goes into route headers and metrics

    def stream(self, request: ChatRequest) -> AsyncIterator[Event]: ...


@dataclass(frozen=True, slots=True)
class ModelInfo:
    id: str
    architecture: str = "unknown"
    parameters: int | None = None
    context_length: int | None = None
    owned_by: str = "local"  # node id of the server, or "local"


@dataclass(slots=True)
class Route:
    """One candidate target for a model, best first in a list of routes."""

    upstream: Upstream
    kind: str = "local"  # "local" | "peer"
    peer: str | None = None


class ModelDirectory(Protocol):
    def models(self) -> Sequence[ModelInfo]:
        """Every model reachable from this node (local and via peers), each id once."""
        ...

    def routes(self, model: str, session_key: str | None = None) -> list[Route]:
        """Candidate routes for ``model``, best first; empty when nobody serves it."""
        ...


@dataclass
class StaticDirectory:
    """A fixed model → upstream mapping: the one-node gateway and tests."""

    entries: dict[str, tuple[ModelInfo, list[Route]]] = field(default_factory=dict)

    def add(self, info: ModelInfo, upstream: Upstream, kind: str = "local") -> None:
        _, routes = self.entries.setdefault(info.id, (info, []))
        routes.append(
            Route(upstream=upstream, kind=kind, peer=None if kind == "local" else upstream.name)
        )

    def models(self) -> list[ModelInfo]:
        return [info for info, _ in self.entries.values()]

    def routes(self, model: str, session_key: str | None = None) -> list[Route]:
        entry = self.entries.get(model)
        return list(entry[1]) if entry else []
