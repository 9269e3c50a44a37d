"""The narrow seam between the gateway and whatever serves a model.

An :class:`Upstream` takes a :class:`ChatRequest` and yields internal events ending with exactly
one ``Done`` or ``Error``. The gateway never knows whether that is the local worker (HTTP on
loopback), a peer (QUIC tunnel, in ``mesh``) or a test double (:mod:`gateway.testing`).

Besides ``stream``, every upstream has the same few capabilities, with defaults (subclass
:class:`Upstream` to inherit them): ``retryable`` (may the router retry it before the commit
point), ``start_hold`` (how long the gateway may hold the response start for a late decision),
``count_tokens`` (an exact prompt count, or None) and ``aclose``.

A :class:`ModelDirectory` is the read-only view of which models are reachable and how to reach
them. ``mesh`` implements it over its peer table; a one-node gateway uses :class:`StaticDirectory`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from gateway.events import Event
from gateway.request import ChatRequest

MESH_MODEL = "mesh"  # the mixture-of-agents model name


async def close_stream(source: AsyncIterator[Event]) -> None:
    """Close an upstream's event stream now (not when the GC finds it): an async generator has
    ``aclose``; a plain async iterator has nothing to close."""
    closer = getattr(source, "aclose", None)
    if closer is not None:
        await closer()


@dataclass(frozen=True, slots=True)
class StartHold:
    """An upstream that decides late: the gateway holds the response start until ``header``
    arrives in a ``Meta`` (content included), for at most ``wait_s`` seconds."""

    header: str
    wait_s: float


@runtime_checkable
class Upstream(Protocol):
    """Something that serves models. ``stream`` must always end with ``Done`` or ``Error``."""

    name: str  # "local" or a peer's node id: goes into route headers and metrics
    # False when a retry would repeat work the upstream already spread (the MoA's fan-out).
    retryable: bool = True

    def stream(self, request: ChatRequest) -> AsyncIterator[Event]: ...

    @property
    def start_hold(self) -> StartHold | None:
        """Hold the response start for a decision (``model="mesh"``); None: the first event."""
        return None

    async def count_tokens(self, request: ChatRequest) -> int | None:
        """The exact prompt token count, or None when this upstream cannot tell."""
        return None

    async def aclose(self) -> None:
        """Release connections; the upstream is not used afterwards."""
        return None  # a default, not an abstract method: most upstreams hold nothing to release


@dataclass(frozen=True, slots=True)
class ModelInfo:
    id: str
    architecture: str = "unknown"
    parameters: int | None = None
    context_length: int | None = None
    owned_by: str = "local"  # node id of the server, or "local"
    # What the worker says it can do: tools ("native" or "generic": the gateway-side tool
    # prompt), thinking, context_length. Empty when unknown.
    capabilities: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Route:
    """One candidate target for a model, best first in a list of routes."""

    upstream: Upstream
    kind: str = "local"  # "local" | "peer"
    peer: str | None = None
    # Why the mesh picked it (``cache 18432/20100``, ``load``, ``sticky`` …): x-mesh-route-reason
    reason: str | None = None


class ModelDirectory(Protocol):
    def models(self) -> Sequence[ModelInfo]:
        """Every model reachable from this node (local and via peers), each id once."""
        ...

    def routes(self, model: str, session_key: str | None = None) -> list[Route]:
        """Candidate routes for ``model``, best first; empty when nobody serves it."""
        ...

    def recently_served(self, model: str) -> bool:
        """``model`` has no route now but had one lately (its only server is down): a request
        for it is worth retrying (503), unlike one for a model nobody knows (404)."""
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

    def remove(self, model: str) -> None:
        """Unlist ``model``."""
        self.entries.pop(model, None)

    def withdraw(self, model: str) -> None:
        """Keep ``model`` listed with no route (its worker is restarting, its split group
        broken): a request for it is then 503 with Retry-After, not 404 – SDKs retry that."""
        info, _ = self.entries.get(model, (ModelInfo(id=model), []))
        self.entries[model] = (info, [])

    def models(self) -> list[ModelInfo]:
        return [info for info, _ in self.entries.values()]

    def routes(self, model: str, session_key: str | None = None) -> list[Route]:
        entry = self.entries.get(model)
        return list(entry[1]) if entry else []

    def recently_served(self, model: str) -> bool:
        return False  # its models never go away
