"""Which offers a split's plan may use (pure): ``--split-over`` exactly, ``--split N`` the
members offering most and then this node, no flag the fewest of all; and its refusals."""

from __future__ import annotations

import pytest

from mesh.errors import PlanError
from mesh.split.plan import Offer, choose_offers, node_of, plan_split
from tests.unit.mesh.split.test_plan import MB, make_layout

SELF = "a" * 64
B, C = "b" * 64, "c" * 64
REMOTE = [Offer(B, 300 * MB), Offer(C, 500 * MB)]


def test_split_over_names_exactly_the_nodes_in_its_order_of_memory() -> None:
    offers, ranks = choose_offers(SELF, 100 * MB, REMOTE, ranks=2, over=["bbb"])
    assert [o.node_id for o in offers] == [SELF, B] and ranks == 2


def test_split_over_self_puts_more_ranks_here_sharing_this_nodes_memory() -> None:
    offers, ranks = choose_offers(SELF, 90 * MB, [], ranks=3, over=["self", "self"])
    assert [node_of(o.node_id) for o in offers] == [SELF] * 3 and ranks == 3
    assert len({o.node_id for o in offers}) == 3
    assert {o.offered_bytes for o in offers} == {30 * MB}


@pytest.mark.parametrize(
    ("over", "words"),
    [(["d"], "no linked member"), (["b", "bb"], "twice"), ([""], "several members")],
)
def test_split_over_refuses_in_words(over: list[str], words: str) -> None:
    with pytest.raises(PlanError, match=words):
        choose_offers(SELF, MB, REMOTE, ranks=2, over=over)


def test_split_n_takes_the_largest_offers_then_this_node() -> None:
    offers, ranks = choose_offers(SELF, 100 * MB, REMOTE, ranks=2)
    assert [o.node_id for o in offers] == [SELF, C] and ranks == 2
    offers, ranks = choose_offers(SELF, 100 * MB, REMOTE, ranks=4)
    assert [node_of(o.node_id) for o in offers] == [SELF, SELF, C, B] and ranks == 4


def test_without_a_count_the_plan_uses_the_fewest_nodes_that_hold_it() -> None:
    offers, ranks = choose_offers(SELF, 100 * MB, REMOTE, ranks=0)
    assert ranks == 1
    plan = plan_split("m", make_layout([50 * MB] * 10), offers, head=SELF, context_length=16)
    assert [s.node_id for s in plan.stages] == [C, SELF]  # 500 MB of layers: C and this node


def test_this_nodes_own_id_among_the_offers_is_ignored() -> None:
    offers, _ = choose_offers(SELF, 100 * MB, [Offer(SELF, 10**12), *REMOTE], ranks=2)
    assert offers[0] == Offer(SELF, 100 * MB, "this node")
