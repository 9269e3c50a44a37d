"""The split plan (pure): which node runs which contiguous layers of one model.

Input: the model's :class:`~worker.split.layout.ModelLayout` (bytes per layer, shared bytes, KV cost
per token), the nodes that offer memory, and the context length to reserve KV cache for. Output:
a :class:`SplitPlan` (stages in layer order, each a rank on one node) or a :class:`PlanError`
whose message is one sentence a person can act on.

How it decides, deterministically (same inputs, same plan, on every node):

- Every rank holds the shared weights (embeddings, final norm, head: each rank computes the
  logits, as in mlx-lm's ``pipeline()``) plus ``rank_overhead_bytes`` of working memory; what is
  left of its offer is its room for layers, whose cost is their weights plus their KV cache at
  ``context_length`` tokens (a sliding-window layer's at most its window).
- The head (the node that serves the model's HTTP API) is rank 0 and always takes part. Other
  nodes join in order of offered memory (largest first, node id to break ties), and the plan
  uses the fewest nodes that can hold the model: every hop costs latency per token.
- Layers go to ranks so that the largest fraction of any node's room in use is as small as it
  can be (exact, by dynamic programming over the cut points), every rank getting at least one
  layer. Uneven offers give uneven splits.
- Rank order follows mlx-lm's ``pipeline()``: the *last* rank runs the first layers and rank 0
  the last ones, so a model with a native ``pipeline()`` and a wrapped one split the same way.

Tensor parallelism (mlx-lm ``shard()``) would be one more plan mode: every rank holds 1/n of
every layer (so it needs ``weights/n + kv/n + shared`` each, and nodes with a fast link, since it
does two all-reduces per layer); ``SplitPlan.mode`` is where it would go.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mesh.errors import PlanError
from worker.split.layout import ModelLayout


@dataclass(frozen=True)
class Offer:
    """A node's offer: how many bytes of its memory a split rank may use there."""

    node_id: str
    offered_bytes: int
    label: str = ""  # what a person calls it (host name); defaults to the id's prefix

    @property
    def name(self) -> str:
        return self.label or self.node_id[:8]


@dataclass(frozen=True)
class Stage:
    """One rank's part: layers ``[start, end)`` on one node, and what they cost there."""

    rank: int
    node_id: str
    name: str
    start: int
    end: int
    weight_bytes: int
    kv_bytes: int
    shared_bytes: int
    overhead_bytes: int
    offered_bytes: int

    @property
    def layers(self) -> int:
        return self.end - self.start

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.shared_bytes + self.overhead_bytes


@dataclass(frozen=True)
class SplitPlan:
    """Stages in layer order (the first runs layer 0; the last is rank 0, the head)."""

    model: str
    num_layers: int
    context_length: int
    stages: tuple[Stage, ...]
    mode: str = "pipeline"

    @property
    def ranks(self) -> int:
        return len(self.stages)

    def by_rank(self) -> tuple[Stage, ...]:
        return tuple(sorted(self.stages, key=lambda s: s.rank))

    def headroom_bytes(self) -> int:
        """What the tightest rank has left of its offer after its stage: room for the prompt
        cache's entries, which every rank holds for its own layers."""
        return max(0, min(s.offered_bytes - s.total_bytes for s in self.stages))

    def layer_split(self) -> list[int]:
        """Layers per rank, indexed by rank: the ``split`` argument of mlx-lm's ``pipeline()``."""
        return [s.layers for s in self.by_rank()]

    def render(self) -> str:
        """The plan as a person reads it before it starts (one line per stage)."""
        head = (
            f"{self.model}: {self.num_layers} layers, {self.context_length}-token context, "
            f"{self.mode} over {self.ranks} rank{'s' if self.ranks != 1 else ''}"
        )
        width = max(len(s.name) for s in self.stages)
        lines = [head]
        for i, s in enumerate(self.stages, 1):
            share = s.total_bytes / s.offered_bytes if s.offered_bytes else 0.0
            lines.append(
                f"  stage {i}/{self.ranks}  rank {s.rank}  {s.name:<{width}}  "
                f"layers {s.start:>3}-{s.end - 1:<3}  weights {_size(s.weight_bytes)}  "
                f"kv {_size(s.kv_bytes)}  shared {_size(s.shared_bytes + s.overhead_bytes)}  "
                f"= {_size(s.total_bytes)} of {_size(s.offered_bytes)} offered ({share:.0%})"
            )
        return "\n".join(lines)


def plan_split(
    model: str,
    layout: ModelLayout,
    offers: Sequence[Offer],
    *,
    head: str,
    context_length: int,
    min_ranks: int = 1,
    rank_overhead_bytes: int = 0,
) -> SplitPlan:
    """Plan ``model`` over ``offers`` with node ``head`` as rank 0 (see the module docstring).

    ``min_ranks`` forces a split (``mesh up --split`` uses 2) even when fewer nodes would do.
    Raises :class:`PlanError` when no set of the offered nodes can hold it."""
    costs = [
        layout.layer_bytes[i] + layout.kv_bytes(i, context_length) for i in range(layout.num_layers)
    ]
    fixed = layout.shared_bytes + rank_overhead_bytes
    ordered = _ordered(offers, head)
    usable = [o for o in ordered if o.offered_bytes > fixed]
    if not usable or usable[0].node_id != head:
        raise PlanError(
            f"{model} cannot be split: the serving node offers {_size(_offer_of(ordered, head))}, "
            f"less than the {_size(fixed)} every rank needs for the shared weights "
            f"(pass --share-memory with more)"
        )
    largest = max(costs)
    for count in range(max(min_ranks, 1), min(len(usable), layout.num_layers) + 1):
        chosen = usable[:count]
        rooms = [o.offered_bytes - fixed for o in reversed(chosen)]  # layer order
        bounds = _balanced(costs, rooms)
        if bounds is not None:
            return _make_plan(model, layout, chosen, bounds, costs, context_length, fixed)
    raise _no_fit(model, layout, usable, costs, largest, fixed, context_length, min_ranks)


def _ordered(offers: Sequence[Offer], head: str) -> list[Offer]:
    """The head first, then the others by offered memory (largest first), then node id."""
    by_id = {o.node_id: o for o in offers}  # one offer per node: the last one given wins
    others = sorted(
        (o for o in by_id.values() if o.node_id != head),
        key=lambda o: (-o.offered_bytes, o.node_id),
    )
    return ([by_id[head]] if head in by_id else []) + others


def _balanced(costs: list[int], rooms: list[int]) -> list[int] | None:
    """Cut points (``len(rooms) + 1`` of them) of the contiguous split, one non-empty stage per
    room in order, that minimises the largest share of a room in use; None when the best one
    still overfills a room. Dynamic programming over (stage, cut): exact, and cheap for the
    tens of layers and handful of nodes a plan has."""
    n, k = len(costs), len(rooms)
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    # best[s][i]: the smallest worst share when stages 0..s-1 hold layers [0, i).
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for s in range(1, k + 1):
        room = rooms[s - 1]
        for i in range(s, n - (k - s) + 1):
            for j in range(s - 1, i):
                if best[s - 1][j] == inf:
                    continue
                share = max(best[s - 1][j], (prefix[i] - prefix[j]) / room)
                if share < best[s][i]:
                    best[s][i], cut[s][i] = share, j
    if best[k][n] > 1.0:
        return None
    cuts = [n]
    for s in range(k, 0, -1):
        cuts.append(cut[s][cuts[-1]])
    return cuts[::-1]


def _make_plan(
    model: str,
    layout: ModelLayout,
    chosen: list[Offer],
    cuts: list[int],
    costs: list[int],
    context_length: int,
    fixed: int,
) -> SplitPlan:
    stages = []
    count = len(chosen)
    for position, offer in enumerate(reversed(chosen)):
        start, end = cuts[position], cuts[position + 1]
        weights = sum(layout.layer_bytes[start:end])
        stages.append(
            Stage(
                rank=count - 1 - position,
                node_id=offer.node_id,
                name=offer.name,
                start=start,
                end=end,
                weight_bytes=weights,
                kv_bytes=sum(costs[start:end]) - weights,
                shared_bytes=layout.shared_bytes,
                overhead_bytes=fixed - layout.shared_bytes,
                offered_bytes=offer.offered_bytes,
            )
        )
    return SplitPlan(model, layout.num_layers, context_length, tuple(stages))


def _no_fit(
    model: str,
    layout: ModelLayout,
    usable: list[Offer],
    costs: list[int],
    largest: int,
    fixed: int,
    context_length: int,
    min_ranks: int,
) -> PlanError:
    if len(usable) < min_ranks:
        return PlanError(
            f"{model} cannot be split {min_ranks} ways: only {len(usable)} node(s) offer more "
            f"than the {_size(fixed)} a rank needs for its shared weights (--share-memory GB)"
        )
    room = max(o.offered_bytes for o in usable) - fixed
    if largest > room:
        return PlanError(
            f"{model} cannot be split: one of its layers needs {_size(largest)} with a "
            f"{context_length}-token KV cache, more than the {_size(room)} any node has left"
        )
    need = sum(costs)
    have = sum(o.offered_bytes - fixed for o in usable)
    return PlanError(
        f"{model} needs {_size(need)} for its {layout.num_layers} layers and a "
        f"{context_length}-token KV cache (plus {_size(fixed)} per node), but the "
        f"{len(usable)} node(s) offering memory have only {_size(have)} left for layers "
        f"(offer more with --share-memory, add nodes, or use a shorter context)"
    )


def _offer_of(offers: list[Offer], node_id: str) -> int:
    return next((o.offered_bytes for o in offers if o.node_id == node_id), 0)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


LOCAL = "self"  # in ``--split-over``: one more rank on this node


def local_rank_id(node_id: str, k: int) -> str:
    """The offer id of this node's k-th extra rank (k ≥ 1): the node id, ``#``, k."""
    return f"{node_id}#{k}"


def node_of(offer_id: str) -> str:
    """The node an offer id belongs to (an extra local rank's id names its node)."""
    return offer_id.split("#", 1)[0]


def choose_offers(
    self_id: str,
    self_bytes: int,
    remote: Sequence[Offer],
    *,
    ranks: int,
    over: Sequence[str] = (),
) -> tuple[list[Offer], int]:
    """Which offers a plan may use, and its ``min_ranks`` (pure; the head is ``self_id``).

    - ``over`` names the other ranks' nodes exactly (node ids or unique prefixes; ``self``
      for one more rank here): the plan uses all of them and nothing else.
    - else ``ranks`` ≥ 2 forces that many ranks: the members that offer the most memory
      first, then extra ranks on this node for the rest.
    - else (``ranks`` 0) the plan takes the fewest of all offers that hold the model.
    This node's own offer is shared equally by the ranks it runs."""
    by_id = {o.node_id: o for o in remote if o.node_id != self_id}
    if over:
        chosen: list[Offer] = []
        extras = 0
        for entry in over:
            if entry.strip().lower() == LOCAL:
                extras += 1
                continue
            matches = [o for n, o in by_id.items() if n.startswith(entry.strip().lower())]
            if len(matches) != 1:
                raise PlanError(
                    f"--split-over {entry}: "
                    + ("names several members; give more of the id" if matches else
                       "no linked member with that id offers memory (--share-memory) now")
                )  # fmt: skip
            if matches[0] in chosen:
                raise PlanError(f"--split-over names {entry} twice")
            chosen.append(matches[0])
        return _with_local(self_id, self_bytes, extras) + chosen, len(over) + 1
    if ranks >= 2:
        others = sorted(by_id.values(), key=lambda o: (-o.offered_bytes, o.node_id))[: ranks - 1]
        extras = ranks - 1 - len(others)
        return _with_local(self_id, self_bytes, extras) + others, ranks
    return _with_local(self_id, self_bytes, 0) + list(by_id.values()), 1


def _with_local(self_id: str, self_bytes: int, extras: int) -> list[Offer]:
    share = self_bytes // (extras + 1)
    head = [Offer(self_id, share, "this node")]
    return head + [
        Offer(local_rank_id(self_id, k), share, f"this node, rank {k}")
        for k in range(1, extras + 1)
    ]


FIT_SHARE = 0.75  # of a node's memory a whole model may take (macOS wires ~75% for the GPU)


def whole_model_bytes(layout: ModelLayout, context_length: int) -> int:
    """What serving the model unsplit costs: every layer with its KV cache, and the rest."""
    layers = sum(
        layout.layer_bytes[i] + layout.kv_bytes(i, context_length) for i in range(layout.num_layers)
    )
    return layers + layout.shared_bytes


def fits_whole(layout: ModelLayout, context_length: int, memory_bytes: int) -> bool:
    """Whether one node with ``memory_bytes`` can serve the model unsplit."""
    return whole_model_bytes(layout, context_length) <= memory_bytes * FIT_SHARE
