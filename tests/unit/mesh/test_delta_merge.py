"""DeltaMerge: which deltas merge, in what order they leave, and that no text is lost."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.events import ReasoningDelta, TextDelta, ToolCallDelta, Usage
from mesh.delta_merge import DeltaMerge, mergeable


def test_plain_text_deltas_merge_and_per_token_fields_or_other_events_never_do() -> None:
    assert mergeable(TextDelta("a"))
    assert not mergeable(TextDelta("a", logprob=-0.5))  # MoA scores each delta's logprob
    assert not mergeable(ReasoningDelta("r"))  # counted as reasoning tokens (Responses)
    assert not mergeable(ToolCallDelta(index=0, arguments="{"))
    assert not mergeable(Usage(1, 2))


def test_neighbours_become_one_delta_and_the_merge_empties() -> None:
    merge = DeltaMerge()
    assert not merge.pending and merge.take() is None
    for text in ("a", "b", "c"):
        assert merge.add(TextDelta(text)) is None
    assert merge.pending
    assert merge.take() == TextDelta("abc")
    assert not merge.pending and merge.take() is None


def test_a_merged_delta_stays_under_max_chars() -> None:
    merge = DeltaMerge(max_chars=4)
    assert merge.add(TextDelta("ab")) is None
    assert merge.add(TextDelta("cd")) is None
    assert merge.add(TextDelta("e")) == TextDelta("abcd")
    assert merge.add(TextDelta("toolong")) == TextDelta("e")  # a long one still goes, alone
    assert merge.take() == TextDelta("toolong")


@given(
    st.lists(st.text(max_size=5), max_size=40),
    st.integers(min_value=1, max_value=12),
    st.sets(st.integers(0, 40)),
)
def test_every_text_leaves_once_and_in_order(texts, max_chars, flushes) -> None:
    merge, sent = DeltaMerge(max_chars=max_chars), []
    for i, text in enumerate(texts):
        if i in flushes:  # a flush between two deltas
            sent.append(merge.take())
        sent.append(merge.add(TextDelta(text)))
    sent.append(merge.take())
    deltas = [d for d in sent if d is not None]
    assert "".join(d.text for d in deltas) == "".join(texts)
    assert all(len(d.text) <= max(max_chars, *map(len, texts)) for d in deltas)
    assert len(deltas) <= len(texts)
