"""The split planner (pure): coverage, fit, optimality, determinism and its one-sentence refusals."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mesh.errors import PlanError
from mesh.split.plan import Offer, SplitPlan, plan_split
from worker.split.layout import ModelLayout

MB = 1_000_000


def make_layout(
    layer_bytes: list[int],
    shared: int = 0,
    kv_per_token: int = 0,
    window: list[int | None] | None = None,
) -> ModelLayout:
    n = len(layer_bytes)
    return ModelLayout(
        num_layers=n,
        layer_bytes=tuple(layer_bytes),
        shared_bytes=shared,
        kv_bytes_per_token=(kv_per_token,) * n,
        window=tuple(window or [None] * n),
        context_length=4096,
        layer_files=(("model.safetensors",),) * n,
        shared_files=("model.safetensors",),
    )


def check_plan(plan: SplitPlan, layout: ModelLayout, offers: list[Offer], head: str) -> None:
    stages = plan.stages
    assert stages[0].start == 0 and stages[-1].end == layout.num_layers
    for before, after in itertools.pairwise(stages):
        assert before.end == after.start
    assert all(s.layers >= 1 for s in stages)
    # mlx-lm's order: the last rank runs the first layers, rank 0 (the head) the last ones.
    assert [s.rank for s in stages] == list(range(plan.ranks - 1, -1, -1))
    assert stages[-1].node_id == head
    offered = {o.node_id: o.offered_bytes for o in offers}
    for s in stages:
        assert s.total_bytes <= offered[s.node_id] == s.offered_bytes
    assert len({s.node_id for s in stages}) == plan.ranks
    assert sum(plan.layer_split()) == layout.num_layers


def brute_best(costs: list[int], rooms: list[int]) -> float | None:
    """The smallest worst share over every contiguous split into len(rooms) non-empty stages."""
    n, k = len(costs), len(rooms)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        share = max(
            sum(costs[a:b]) / r for (a, b), r in zip(itertools.pairwise(bounds), rooms, strict=True)
        )
        best = share if best is None else min(best, share)
    return best


def test_uneven_offers_give_uneven_layers() -> None:
    layout = make_layout([10 * MB] * 12)
    offers = [Offer("head", 40 * MB, "mac-mini"), Offer("big", 80 * MB, "studio")]
    plan = plan_split("big-model", layout, offers, head="head", context_length=1024)
    assert plan.ranks == 2
    first, last = plan.stages
    assert (first.node_id, first.rank, first.layers) == ("big", 1, 8)
    assert (last.node_id, last.rank, last.layers) == ("head", 0, 4)
    assert plan.layer_split() == [4, 8]
    check_plan(plan, layout, offers, "head")


def test_kv_cache_for_the_context_is_reserved_and_windows_cap_it() -> None:
    # 4 layers of 10 MB; 1 kB of KV per token per layer: 4096 tokens = 4.1 MB per layer.
    layout = make_layout([10 * MB] * 4, kv_per_token=1000)
    plan = plan_split("m", layout, [Offer("a", 60 * MB)], head="a", context_length=4096)
    assert plan.stages[0].kv_bytes == 4 * 4096 * 1000
    with pytest.raises(PlanError):
        plan_split("m", layout, [Offer("a", 50 * MB)], head="a", context_length=4096)
    # A 512-token window on three of the layers makes the same context fit in 50 MB.
    slid = make_layout([10 * MB] * 4, kv_per_token=1000, window=[512, 512, 512, None])
    plan = plan_split("m", slid, [Offer("a", 50 * MB)], head="a", context_length=4096)
    assert plan.stages[0].kv_bytes == (3 * 512 + 4096) * 1000


def test_fewest_nodes_unless_forced() -> None:
    layout = make_layout([MB] * 6, shared=MB)
    offers = [Offer("h", 100 * MB), Offer("x", 100 * MB), Offer("y", 100 * MB)]
    assert plan_split("m", layout, offers, head="h", context_length=16).ranks == 1
    forced = plan_split("m", layout, offers, head="h", context_length=16, min_ranks=3)
    assert forced.ranks == 3 and forced.layer_split() == [2, 2, 2]
    check_plan(forced, layout, offers, "h")


def test_shared_weights_count_on_every_rank() -> None:
    layout = make_layout([10 * MB] * 4, shared=30 * MB)
    offers = [Offer("h", 55 * MB), Offer("x", 55 * MB)]
    plan = plan_split("m", layout, offers, head="h", context_length=1, rank_overhead_bytes=5 * MB)
    assert plan.layer_split() == [2, 2]
    assert all(s.total_bytes == 30 * MB + 5 * MB + 20 * MB for s in plan.stages)


@pytest.mark.parametrize(
    ("offers", "words"),
    [
        ([Offer("h", 15 * MB), Offer("x", 15 * MB)], "needs 40.0 MB for its 4 layers"),
        ([Offer("h", MB), Offer("x", 100 * MB)], "the serving node offers 1.0 MB"),
        ([Offer("h", 100 * MB)], "cannot be split 2 ways"),
    ],
)
def test_a_model_no_members_can_hold_is_one_sentence(offers: list[Offer], words: str) -> None:
    layout = make_layout([10 * MB] * 4, shared=2 * MB)
    with pytest.raises(PlanError) as caught:
        plan_split("huge", layout, offers, head="h", context_length=8, min_ranks=2)
    message = str(caught.value)
    assert words in message and message.startswith("huge")
    assert "\n" not in message and message.count(". ") == 0


def test_a_layer_too_big_for_any_node_says_so() -> None:
    layout = make_layout([MB, 50 * MB, MB])
    offers = [Offer("h", 40 * MB), Offer("x", 40 * MB), Offer("y", 40 * MB)]
    with pytest.raises(PlanError, match=r"one of its layers needs 50\.0 MB"):
        plan_split("m", layout, offers, head="h", context_length=1)


def test_render_names_every_stage() -> None:
    layout = make_layout([10 * MB] * 6, shared=MB)
    offers = [Offer("h" * 64, 50 * MB, "laptop"), Offer("b" * 64, 50 * MB)]
    plan = plan_split("m", layout, offers, head="h" * 64, context_length=256, min_ranks=2)
    text = plan.render()
    assert text.splitlines()[0] == "m: 6 layers, 256-token context, pipeline over 2 ranks"
    assert "stage 1/2  rank 1  bbbbbbbb" in text and "layers   0-2" in text
    assert "stage 2/2  rank 0  laptop  " in text and "layers   3-5" in text
    assert "= 31.0 MB of 50.0 MB offered (62%)" in text


sizes = st.integers(min_value=1, max_value=50)


@given(
    layers=st.lists(sizes, min_size=1, max_size=9),
    offers=st.lists(st.integers(min_value=0, max_value=120), min_size=1, max_size=4),
    shared=st.integers(min_value=0, max_value=10),
    min_ranks=st.integers(min_value=1, max_value=3),
)
def test_plans_fit_cover_and_are_optimal(
    layers: list[int], offers: list[int], shared: int, min_ranks: int
) -> None:
    layout = make_layout(layers, shared=shared)
    nodes = [Offer(f"n{i}", size) for i, size in enumerate(offers)]
    try:
        plan = plan_split("m", layout, nodes, head="n0", context_length=1, min_ranks=min_ranks)
    except PlanError:
        plan = None
    # Brute force: the head plus the k-1 largest others, for the fewest k that fit.
    others = sorted(nodes[1:], key=lambda o: (-o.offered_bytes, o.node_id))
    expected = None
    if offers[0] > shared:
        usable = [nodes[0], *(o for o in others if o.offered_bytes > shared)]
        for k in range(min_ranks, min(len(usable), len(layers)) + 1):
            rooms = [o.offered_bytes - shared for o in reversed(usable[:k])]
            best = brute_best(layers, rooms)
            if best is not None and best <= 1.0:
                expected = (k, best)
                break
    if expected is None:
        assert plan is None
        return
    assert plan is not None
    check_plan(plan, layout, nodes, "n0")
    k, best = expected
    assert plan.ranks == k
    worst = max((s.weight_bytes) / (s.offered_bytes - shared) for s in plan.stages)
    assert worst == pytest.approx(best)


@given(st.permutations([Offer("h", 70), Offer("a", 50), Offer("b", 50), Offer("c", 90)]))
def test_the_same_offers_in_any_order_give_the_same_plan(offers: list[Offer]) -> None:
    layout = make_layout([10] * 13, shared=3)
    plan = plan_split("m", layout, offers, head="h", context_length=1, min_ranks=4)
    reference = plan_split(
        "m",
        layout,
        sorted(offers, key=lambda o: o.node_id),
        head="h",
        context_length=1,
        min_ranks=4,
    )
    assert plan == reference
    assert [s.node_id for s in plan.stages] == ["b", "a", "c", "h"]


def test_headroom_is_what_the_tightest_rank_has_left() -> None:
    layout = make_layout([10 * MB] * 4)
    plan = plan_split(
        "m", layout, [Offer("a", 30 * MB), Offer("b", 25 * MB)], head="a", context_length=16
    )
    assert plan.headroom_bytes() == min(s.offered_bytes - s.total_bytes for s in plan.stages)
    assert plan.headroom_bytes() == 5 * MB  # each holds two 10 MB layers
