"""The "split models" section of ``mesh status``, from the ``/api/status`` picture. Pure.

Every split model in the mesh with its stages in layer order (rank, node, layers); for this
node the ranks it runs for others and its models waiting for members to offer memory (the one
sentence why) or still forming; and the memory each member offers for ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mesh.identity import short_id

Who = Callable[[str], str]


def split_section(status: Mapping[str, Any]) -> str:
    """The section's text; empty when nothing in the mesh is split or offers memory."""
    node = status.get("node") or {}
    self_id = str(node.get("node_id", ""))
    split = node.get("split") or {}
    peers = [p for p in status.get("peers", []) if p.get("state", "up") == "up"]

    def who(node_id: str) -> str:
        return "this node" if node_id == self_id else short_id(node_id)

    served = [(self_id, m) for m in node.get("models", [])]
    served += [(self_id, {"name": n, "stages": st}) for n, st in split.get("groups", {}).items()]
    served += [(str(p["node_id"]), m) for p in peers for m in p.get("models", [])]
    shown: set[tuple[str, str]] = set()
    lines = _model_lines(served, who, shown)
    lines += [
        f"  this node runs rank {r['rank']} of {r['model']} for {who(str(r['head']))}"
        for r in split.get("ranks", [])
    ]
    lines += _waiting_lines(
        split, status.get("workers") or {}, {n for n, h in shown if h == self_id}
    )
    offering = [n for n in [node, *peers] if int(n.get("share_memory") or 0) > 0]
    if offering:
        lines += _offer_lines(offering, who)
    elif lines:
        lines.append("  no member offers memory for ranks (mesh up --share-memory GB)")
    return "\n".join(["split models", *lines]) if lines else ""


def _model_lines(served: list[tuple[str, Any]], who: Who, shown: set[tuple[str, str]]) -> list[str]:
    """Each split model once per head (node models, groups led here, peers' ads)."""
    lines = []
    for head, model in served:
        stages = model.get("stages") or []
        if not stages or (model["name"], head) in shown:
            continue
        shown.add((model["name"], head))
        layers = max(int(s["end"]) for s in stages)
        lines.append(
            f"  {model['name']}  {layers} layers over {len(stages)} ranks, served by {who(head)}"
        )
        width = max(len(who(str(s["node_id"]))) for s in stages)
        lines += [
            f"    rank {s['rank']}  {who(str(s['node_id'])):<{width}}  "
            f"{layer_range(int(s['start']), int(s['end']))}"
            for s in stages
        ]
    return lines


def _waiting_lines(
    split: Mapping[str, Any], workers: Mapping[str, Any], running: set[str]
) -> list[str]:
    """Models waiting for memory (the coordinator's word, else the worker's), or forming."""
    waiting = dict(split.get("waiting", {}))
    forming = []
    for name, worker in workers.items():
        own = worker.get("split") or {}
        if own.get("waiting"):
            waiting.setdefault(name, own["waiting"])
        elif own.get("forming") and name not in waiting and name not in running:
            forming.append(f"  {name}: forming its group")
    return forming + [
        f"  {model} waits for members to offer memory: {why}" for model, why in waiting.items()
    ]


def _offer_lines(offering: list[Mapping[str, Any]], who: Who) -> list[str]:
    names = [who(str(n.get("node_id", ""))) for n in offering]
    width = max(len(name) for name in names)
    return ["  memory offered for ranks (mesh up --share-memory):"] + [
        f"    {name:<{width}}  {format_size(int(n['share_memory']))}, "
        f"{format_size(int(n.get('share_memory_used') or 0))} in use"
        for name, n in zip(names, offering, strict=True)
    ]


def layer_range(start: int, end: int) -> str:
    """Layers ``[start, end)`` as people count them, as the plan prints them: "layers 0-2"."""
    return f"layers {start}-{end - 1}" if end - 1 > start else f"layer {start}"


def format_size(n: int) -> str:
    """Bytes in decimal units, as ``--share-memory GB`` takes them."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
