"""The node's status picture: one injected source feeds ``/health``, ``/api/status`` and the console.

``create_app(..., status=source)`` takes a callable that returns the mesh picture::

    {"node": {"node_id": ..., "mesh_id": ..., "models": [...], ...},
     "peers": [{"node_id": ..., "state": "up", ...}, ...],
     "workers": {"<model>": {"restarts": 0}, ...}}        # any of these may be missing

A gateway without a mesh has no source: its picture is just itself and its directory's models.
``/health`` shows a summary of the picture (ids, linked peers, workers), never the whole of it.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gateway.upstream import ModelDirectory

StatusSource = Callable[[], Mapping[str, Any] | Awaitable[Mapping[str, Any]]]


def directory_status(directory: ModelDirectory) -> dict[str, Any]:
    """The mesh picture of a node without a mesh: just itself and the models it can reach."""
    return {
        "node": {
            "id": "local",
            "name": "this node",
            "state": "up",
            "models": [info.id for info in directory.models()],
        },
        "peers": [],
    }


async def read_status(
    source: StatusSource | None, directory: ModelDirectory | None
) -> dict[str, Any]:
    """The whole picture: the source's, filled in from the directory where it says nothing."""
    base = directory_status(directory) if directory is not None else {}
    if source is None:
        return base
    result = source()
    if inspect.isawaitable(result):
        result = await result
    # A source may know only part of the picture (no peers yet): the directory fills the rest.
    return {**base, **result}


def health_facts(picture: Mapping[str, Any]) -> dict[str, Any]:
    """What ``/health`` tells of the picture: who this node is, how many peers, its workers,
    its prompt caches in brief."""
    node = picture.get("node") or {}
    facts: dict[str, Any] = {key: node[key] for key in ("node_id", "mesh_id") if key in node}
    if node.get("cache_stats"):  # each model's prompt cache and memory budget, in brief
        facts["cache_stats"] = node["cache_stats"]
    if "peers" in picture:  # the peers linked now (a row without the flag is a live one)
        facts["peers"] = sum(1 for peer in picture["peers"] if peer.get("connected", True))
    if "workers" in picture:
        facts["workers"] = picture["workers"]
    return facts
