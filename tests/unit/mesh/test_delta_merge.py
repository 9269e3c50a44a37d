"""DeltaMerge: which deltas merge, in what order they leave, and that no text is lost."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.events import ReasoningDelta, TextDelta, ToolCallDelta, Usage
from mesh.delta_merge import DeltaMerge, mergeable


def test_plain_deltas_merge_and_per_token_fields_or_other_events_never_do() -> None:
    assert mergeable(TextDelta("a")) and mergeable(ReasoningDelta("r"))
    assert not mergeable(TextDelta("a", logprob=-0.5))  # MoA scores each delta's logprob
    assert not mergeable(ToolCallDelta(index=0, arguments="{"))
    assert not mergeable(Usage(1, 2))


def test_neighbours_of_one_kind_become_one_delta_and_the_merge_empties() -> None:
    merge = DeltaMerge()
    assert not merge.pending and merge.take() is None
    for text in ("a", "b", "c"):
        assert merge.add(TextDelta(text)) is None
    assert merge.pending
    assert merge.take() == TextDelta("abc")
    assert not merge.pending and merge.take() is None


def test_a_delta_of_another_kind_closes_the_merge_before_it() -> None:
    merge = DeltaMerge()
    merge.add(ReasoningDelta("think "))
    merge.add(ReasoningDelta("more"))
    assert merge.add(TextDelta("answer")) == ReasoningDelta("think more")
    assert merge.add(ReasoningDelta("again")) == TextDelta("answer")
    assert merge.take() == ReasoningDelta("again")


def test_a_merged_delta_stays_under_max_chars() -> None:
    merge = DeltaMerge(max_chars=4)
    assert merge.add(TextDelta("ab")) is None
    assert merge.add(TextDelta("cd")) is None
    assert merge.add(TextDelta("e")) == TextDelta("abcd")
    assert merge.take() == TextDelta("e")


_deltas = st.lists(
    st.one_of(
        st.builds(TextDelta, st.text(max_size=5)), st.builds(ReasoningDelta, st.text(max_size=5))
    ),
    max_size=40,
)


@given(_deltas, st.integers(min_value=1, max_value=12), st.sets(st.integers(0, 40)))
def test_every_text_leaves_once_in_order_and_of_its_kind(deltas, max_chars, takes) -> None:
    merge, out = DeltaMerge(max_chars=max_chars), []
    for i, delta in enumerate(deltas):
        if i in takes:  # a flush between two deltas
            out.append(merge.take())
        out.append(merge.add(delta))
    out.append(merge.take())
    sent = [d for d in out if d is not None]
    for kind in (TextDelta, ReasoningDelta):  # nothing lost, nothing reordered, per kind...
        assert "".join(d.text for d in sent if type(d) is kind) == "".join(
            d.text for d in deltas if type(d) is kind
        )
    # ...and across kinds: the sequence of kinds is the input's with repeats collapsed at most
    kinds = [type(d) for d in deltas]
    assert _runs(type(d) for d in sent) == _runs(kinds)
    # a merged delta exceeds max_chars only when a single delta does
    assert all(len(d.text) <= max(max_chars, *(len(x.text) for x in deltas)) for d in sent)


def _runs(kinds) -> list[type]:
    runs: list[type] = []
    for kind in kinds:
        if not runs or runs[-1] is not kind:
            runs.append(kind)
    return runs
