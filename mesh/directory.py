"""MeshDirectory: the gateway's :class:`~gateway.upstream.ModelDirectory` over the whole mesh.

A model served locally goes to the local routes first; peers that serve it follow (best first,
from the :class:`~mesh.peers.PeerTable`), so a failing local worker still has somewhere to go
before the commit point. A model only peers serve goes to the best peers. ``/v1/models`` lists
every model reachable in the mesh, each once; a model whose only server went down lately is
not listed but still "recently served" (a 503 to retry, not a 404).

The serving side of the tunnel never uses this directory: a forwarded request runs against
the local directory only (``mesh.tunnel_server``), so a request is forwarded at most once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.request import ChatRequest
from gateway.upstream import ModelDirectory, ModelInfo, Route, Upstream
from mesh.peers import PeerTable
from mesh.routing.planner import AskHeld, RoutePlanner, RoutingConfig

MAX_PEER_ROUTES = 3


@dataclass
class MeshDirectory:
    """``local``: this node's own models; ``upstream_for(node_id)``: a peer's upstream."""

    local: ModelDirectory
    peers: PeerTable
    upstream_for: Callable[[str], Upstream]
    max_peer_routes: int = MAX_PEER_ROUTES
    clock: Callable[[], float] = time.monotonic  # the peer table's clock
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    local_load: Callable[[], dict[str, Any]] = dict  # the load probe's last answer (digests)
    ask_held: AskHeld | None = None  # a peer's answer to "how much of this prompt do you hold?"
    planner: RoutePlanner = field(init=False)

    def __post_init__(self) -> None:
        self.planner = RoutePlanner(
            self.local,
            self.peers,
            self.upstream_for,
            self.local_load,
            self.routing,
            self.clock,
            ask_held=self.ask_held,
        )

    def models(self) -> list[ModelInfo]:
        out = {info.id: info for info in self.local.models()}
        for name, (ad, node_id) in self.peers.models().items():
            out.setdefault(
                name,
                ModelInfo(
                    id=name,
                    architecture=ad.architecture,
                    parameters=ad.parameters,
                    context_length=ad.context_length,
                    owned_by=node_id,
                    capabilities=dict(ad.capabilities),
                ),
            )
        return list(out.values())

    def routes(self, model: str, session_key: str | None = None) -> list[Route]:
        routes = list(self.local.routes(model, session_key))
        for node_id in self.peers.candidates(model, session_key)[: self.max_peer_routes]:
            routes.append(Route(upstream=self.upstream_for(node_id), kind="peer", peer=node_id))
        return routes

    async def aroutes(self, request: ChatRequest) -> list[Route]:
        """Routes ranked by the prompt's cached prefix, load and RTT (mesh/routing/); [] leaves
        it to :meth:`routes`."""
        return await self.planner.routes(request)

    def all_idle(self, model: str) -> bool:
        """Every node serving ``model`` idle now (``model="mesh"``'s vote: one batch, not waves)."""
        return self.planner.all_idle(model)

    def track_records(self) -> list[dict[str, dict[str, int]]]:
        """Each up peer's ``mesh`` track record (gateway/moa/track_record.py), as gossiped."""
        return [
            {m: ad.model_dump() for m, ad in record.state.track_record.items()}
            for record in self.peers.up()
        ]

    def recently_served(self, model: str) -> bool:
        return self.peers.recently_served(model, self.clock())


def offered_models(local: ModelDirectory) -> list[ModelInfo]:
    """This node's models to advertise to peers: those with a route now. A withdrawn one (its
    worker stuck and restarting, its split group broken or waiting) stays listed here, where
    a request for it is 503, but peers stop routing to it (and answer 503 for it a while)."""
    return [info for info in local.models() if local.routes(info.id)]
