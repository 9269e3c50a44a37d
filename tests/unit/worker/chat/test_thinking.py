"""normalize_thinking (every knob, precedence) and the chunking-invariant ThinkSplitter."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.chat.thinking import THINKING_ALIASES, ThinkSplitter, normalize_thinking


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, None),
        ({"messages": []}, None),
        ({"reasoning_effort": "none"}, False),
        ({"reasoning_effort": "None "}, False),
        ({"reasoning_effort": "minimal"}, True),
        ({"reasoning_effort": "low"}, True),
        ({"reasoning_effort": "medium"}, True),
        ({"reasoning_effort": "high"}, True),
        ({"reasoning_effort": ""}, None),
        ({"reasoning_effort": None}, None),
        ({"reasoning": {"effort": "none"}}, False),
        ({"reasoning": {"effort": "high"}}, True),
        ({"reasoning": {"enabled": False}}, False),
        ({"reasoning": {"enabled": True}}, True),
        ({"reasoning": {"enabled": False, "effort": "high"}}, False),
        ({"reasoning": {"max_tokens": 0}}, False),
        ({"reasoning": {"max_tokens": 512}}, True),
        ({"reasoning": {"exclude": True}}, None),
        ({"reasoning": True}, True),
        ({"reasoning": None}, None),
        ({"thinking_budget": 0}, False),
        ({"thinking_budget": 1024}, True),
        ({"thinking_budget": -1}, True),
        ({"thinking_budget": None}, None),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, True),
        ({"thinking": {"type": "disabled"}}, False),
        ({"thinking": {"type": "adaptive"}}, True),
        ({"thinking": {}}, None),
        ({"thinking": False}, False),
        ({"chat_template_kwargs": {"enable_thinking": False}}, False),
        ({"chat_template_kwargs": {"enable_thinking": True}}, True),
        ({"chat_template_kwargs": {"thinking": True}}, True),
        ({"chat_template_kwargs": {"reasoning_effort": "none"}}, False),
        ({"chat_template_kwargs": {"other": 1}}, None),
        ({"chat_template_kwargs": None}, None),
        ({"enable_thinking": "false"}, False),
        ({"enable_thinking": "on"}, True),
        ({"enable_thinking": 0}, False),
        ({"enable_thinking": "maybe"}, None),
    ],
)
def test_each_knob(body: dict, expected: bool | None) -> None:
    assert normalize_thinking(body) is expected


@pytest.mark.parametrize("alias", THINKING_ALIASES)
@pytest.mark.parametrize("value", [True, False])
def test_every_alias_top_level_and_in_template_kwargs(alias: str, value: bool) -> None:
    assert normalize_thinking({alias: value}) is value
    assert normalize_thinking({"chat_template_kwargs": {alias: value}}) is value


def test_template_kwargs_win_over_everything() -> None:
    body = {
        "chat_template_kwargs": {"enable_thinking": False},
        "enable_thinking": True,
        "thinking": {"type": "enabled"},
        "reasoning": {"enabled": True},
        "reasoning_effort": "high",
        "thinking_budget": 100,
    }
    assert normalize_thinking(body) is False
    body["chat_template_kwargs"] = {"enable_thinking": True}
    body["enable_thinking"] = False
    assert normalize_thinking(body) is True


def test_precedence_below_template_kwargs() -> None:
    assert normalize_thinking({"enable_thinking": False, "reasoning_effort": "high"}) is False
    assert (
        normalize_thinking({"thinking": {"type": "disabled"}, "reasoning_effort": "high"}) is False
    )
    assert (
        normalize_thinking({"reasoning": {"effort": "none"}, "reasoning_effort": "high"}) is False
    )
    assert normalize_thinking({"reasoning_effort": "none", "thinking_budget": 10}) is False
    # An unreadable stronger knob falls through to the next one.
    assert normalize_thinking({"enable_thinking": "maybe", "reasoning_effort": "none"}) is False


def test_not_a_dict() -> None:
    assert normalize_thinking([]) is None  # type: ignore[arg-type]


def split_all(text_chunks: list[str], in_reasoning: bool) -> tuple[str, str]:
    splitter = ThinkSplitter(in_reasoning=in_reasoning)
    pieces = []
    for chunk in text_chunks:
        pieces.extend(splitter.feed(chunk))
    pieces.extend(splitter.finish())
    reasoning = "".join(t for k, t in pieces if k == "reasoning")
    content = "".join(t for k, t in pieces if k == "content")
    return reasoning, content


def test_basic_split() -> None:
    assert split_all(["<think>\nhmm</think>\n\nHello"], False) == ("hmm", "Hello")


def test_tags_split_across_chunks() -> None:
    chunks = ["<th", "ink>ab", "c</", "thi", "nk>", "\n", "Hi"]
    assert split_all(chunks, False) == ("abc", "Hi")


def test_prompt_opened_block() -> None:
    assert split_all(["plan", " more</think>answer"], True) == ("plan more", "answer")


def test_cut_off_inside_block_stays_reasoning() -> None:
    assert split_all(["<think>still going </thi"], False) == ("still going </thi", "")


def test_no_tags_is_all_content() -> None:
    assert split_all(["just ", "text <b>"], False) == ("", "just text <b>")


def test_state_property() -> None:
    splitter = ThinkSplitter(in_reasoning=True)
    assert splitter.state == "reasoning"
    splitter.feed("x</think>")
    assert splitter.state == "content"


texts = st.lists(
    st.sampled_from(["<think>", "</think>", "<", "th", "ink", ">", "/", "a", " ", "\n", "é"]),
    max_size=30,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(
    text=texts,
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12),
    in_reasoning=st.booleans(),
)
def test_any_chunking_gives_the_same_split(text: str, cuts: list[int], in_reasoning: bool) -> None:
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert split_all(chunks, in_reasoning) == split_all([text], in_reasoning)


@settings(max_examples=200, deadline=None)
@given(
    reasoning=st.text(alphabet="ab <>/\n", max_size=20),
    content=st.text(alphabet="cd <>\n", max_size=20),
)
def test_roundtrip_of_well_formed_output(reasoning: str, content: str) -> None:
    if "</think>" in reasoning or "<think>" in content:
        return
    got_reasoning, got_content = split_all([f"<think>{reasoning}</think>{content}"], False)
    assert got_reasoning == reasoning.lstrip()
    # Everything after the close tag is content (leading whitespace dropped).
    assert got_content == content.lstrip()
