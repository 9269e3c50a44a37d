"""Pure pieces of MoA: quality gates, answer scoring, thinking knobs and candidate planning."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.moa import gates, scoring
from gateway.moa.candidates import (
    mixable_models,
    plan_candidates,
    reducer_request,
    strongest,
    worker_request,
)
from gateway.moa.config import MoaConfig
from gateway.moa.knobs import thinking_opted_in, with_thinking
from gateway.request import ChatRequest, Message
from gateway.testing import ScriptedUpstream, chat_request
from gateway.upstream import ModelInfo, StaticDirectory

V = gates.Verdict


def ask(**fields) -> ChatRequest:
    return ChatRequest(model="mesh", messages=[Message(role="user", content="hi")], **fields)


# -- gates ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "verdict"),
    [
        ("Paris is the capital.", V.PASS),
        ("", V.EMPTY),
        ("  \n ", V.EMPTY),
        ("<think>let me see", V.MARKUP),
        ("ok </think> Paris", V.MARKUP),
        ("Paris<|im_end|>", V.MARKUP),
        ("I'm sorry, but I can't help with that.", V.REFUSAL),
        ("I’m sorry, no.", V.REFUSAL),
        ("As an AI language model, I", V.REFUSAL),
        ("I cannot do that", V.REFUSAL),
        ("Sorry, that is not possible", V.REFUSAL),
        ("I can help: Paris.", V.PASS),
        ("!!!!!!!!!!!!!!!!!!!!", V.REPETITION),
        ("the cat the cat the cat the cat ", V.REPETITION),
        ("Answer: 1000000", V.PASS),
        ("a --- b", V.PASS),
        ("ha ha ha", V.PASS),
    ],
)
def test_judge(text, verdict):
    assert gates.judge(text) is verdict


def test_judge_counts_reasoning_and_tool_calls_as_output():
    assert gates.judge("", reasoning="Let me think") is V.PASS
    assert gates.judge("", reasoning="hmm hmm hmm hmm hmm hmm hmm") is V.REPETITION
    assert gates.judge("", tool_calls=1) is V.PASS


@given(st.text(max_size=200))
@settings(max_examples=200, deadline=None)
def test_gates_never_raise(text):
    assert isinstance(gates.judge(text, reasoning=text[::-1]), gates.Verdict)


@given(st.text(min_size=3, max_size=8).filter(lambda u: u.strip()), st.integers(8, 20))
@settings(max_examples=100, deadline=None)
def test_any_unit_repeated_many_times_is_a_loop(unit, times):
    assert gates.is_repetition_loop("Intro. " + unit * times)


# -- scoring -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b"),
    [("**42**.", "42"), ("  Paris ", "paris"), ("3.50", "3.5"), ("4.0", "4"), ("`x = 1`", "x = 1")],
)
def test_normalize_answer_equates(a, b):
    assert scoring.normalize_answer(a) == scoring.normalize_answer(b)


def test_normalize_answer_keeps_distinct_answers_apart():
    assert scoring.normalize_answer("1,000") != scoring.normalize_answer("1")
    assert scoring.normalize_answer("42") != scoring.normalize_answer("-42")


def test_agreeing_groups_largest_first():
    groups = scoring.agreeing_groups({"a": "4", "b": "5", "c": "**4**", "d": "6"})
    assert groups[0] == ["a", "c"] and len(groups) == 3


def test_prefix_agreement():
    texts = {"a": "The capital of France is", "b": "The capital of Spain", "c": "Madrid"}
    assert sorted(scoring.prefix_agreement(texts, 15)) == ["a", "b"]
    assert scoring.prefix_agreement(texts, 20) == []


def test_stream_score_orders_gates_before_logprob():
    good = scoring.stream_score(
        logprob=-4.0, passes_gates=True, refusal=False, win_rate=0.5, support=0.0, finished=False
    )
    leaked = scoring.stream_score(
        logprob=-0.1, passes_gates=False, refusal=False, win_rate=1.0, support=1.0, finished=True
    )
    refusal = scoring.stream_score(
        logprob=-0.1, passes_gates=True, refusal=True, win_rate=0.5, support=0.0, finished=True
    )
    assert good > refusal > leaked


def test_win_record_rates_are_smoothed_and_learn():
    record = scoring.WinRecord()
    assert record.rate("m") == 0.5
    for _ in range(3):
        record.record(["m", "n"], "m")
    assert record.rate("m") > 0.5 > record.rate("n")
    record.record(["m", "n"], None)  # e.g. the reducer won
    assert record.rounds["m"] == 4


# -- thinking knobs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"reasoning": True},
        {"reasoning_effort": "high"},
        {"reasoning_effort": "low"},
        {"chat_template_kwargs": {"enable_thinking": True}},
        {"chat_template_kwargs": {"thinking": True}},
        {"chat_template_kwargs": {"enable_reasoning": "true"}},
        {"chat_template_kwargs": {"thinking_budget": 512}},
        {"chat_template_kwargs": {"enableThinking": 1}},
        {"chat_template_kwargs": {"thinking": {"type": "enabled", "budget_tokens": 64}}},
    ],
)
def test_each_opt_in_knob_turns_thinking_on(fields):
    request = chat_request(**fields)  # knobs are normalised at the edge
    assert thinking_opted_in(request)
    out = with_thinking(request, True)
    assert out.reasoning is True and out.chat_template_kwargs["enable_thinking"] is True
    assert out.reasoning_effort not in (None, "none")
    assert all(v is True for k, v in out.chat_template_kwargs.items() if k != "thinking_budget")


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"reasoning": False},
        {"reasoning_effort": "none"},
        {"reasoning": False, "reasoning_effort": "high"},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"chat_template_kwargs": {"thinking": "off"}},
        {"chat_template_kwargs": {"thinking_budget": 0}},
    ],
)
def test_thinking_stays_off_without_an_opt_in(fields):
    request = chat_request(**fields)  # knobs are normalised at the edge
    assert not thinking_opted_in(request)
    out = with_thinking(request, False)
    assert out.reasoning is False and out.reasoning_effort == "none"
    assert out.chat_template_kwargs["enable_thinking"] is False
    assert "thinking_budget" not in out.chat_template_kwargs


def test_with_thinking_keeps_other_template_kwargs():
    out = with_thinking(ask(chat_template_kwargs={"foo": 1, "thinking": True}), False)
    assert out.chat_template_kwargs == {"foo": 1, "thinking": False, "enable_thinking": False}


# -- candidates ----------------------------------------------------------------------------------


def directory(*models: tuple[str, int | None], routes: int = 1) -> StaticDirectory:
    d = StaticDirectory()
    for model_id, params in models:
        for r in range(routes):
            d.add(
                ModelInfo(model_id, parameters=params), ScriptedUpstream.of(name=f"{model_id}@{r}")
            )
    return d


def test_one_call_per_distinct_model_largest_first_capped():
    d = directory(("small", 100), ("mesh", None), ("big", 900), ("mid", 500), ("huge", None))
    assert [m.id for m in mixable_models(d)] == ["big", "mid", "small", "huge"]
    plan = plan_candidates(d, ask(session_key="s1"), MoaConfig(max_workers=3))
    assert [c.name for c in plan] == ["big", "mid", "small"]
    assert [c.request.model for c in plan] == ["big", "mid", "small"]
    assert all(c.request.metadata["moa_worker"] == c.name for c in plan)
    assert strongest(mixable_models(d)).id == "big"


def test_self_mixture_samples_one_model_with_different_temperatures_and_seeds():
    d = directory(("solo", 135), routes=2)
    plan = plan_candidates(
        d, ask(temperature=0.2, seed=7, session_key="s"), MoaConfig(max_workers=3)
    )
    assert [c.name for c in plan] == ["solo#0", "solo#1", "solo#2"]
    assert [c.request.temperature for c in plan] == [0.2, 0.7, 1.0]
    assert [c.request.seed for c in plan] == [7, 8, 9]
    assert [c.request.session_key for c in plan] == ["s", "s/moa1", "s/moa2"]
    # Samples are spread over the routes that serve the model.
    assert [c.upstream.name for c in plan] == ["solo@0", "solo@1", "solo@0"]


def test_no_models_no_candidates():
    assert plan_candidates(directory(("mesh", None)), ask(), MoaConfig()) == []


def test_worker_request_drops_moa_metadata_and_carries_thinking_off():
    out = worker_request(ask(metadata={"moa_policy": "race", "user": "x"}), "m", name="m")
    assert out.metadata == {"user": "x", "moa_worker": "m", "logprobs": True}
    assert out.model == "m" and out.stream is True and out.reasoning is False


def test_reducer_request_lists_the_answers_under_the_callers_system_prompt():
    request = ChatRequest(
        model="mesh",
        messages=[Message(role="system", content="Be terse."), Message(role="user", content="Q?")],
    )
    out = reducer_request(request, [("a", "Paris"), ("b", " Lyon ")], ModelInfo("big"))
    assert out.model == "big"
    assert [m.role for m in out.messages] == ["system", "user"]
    system = out.messages[0].content
    assert system.startswith("Be terse.")
    assert "Response 1:\nParis" in system and "Response 2:\nLyon" in system
    assert out.chat_template_kwargs["enable_thinking"] is False


@pytest.mark.parametrize(
    ("text", "conclusive"),
    [
        ("The", True),
        ("42", True),
        ("As a result", True),
        ("Sorry, no", True),  # conclusively a refusal
        ("I", False),
        ("I'm", False),
        ("As an", False),
        ("Sorry", False),
        (" \n", False),
        ("Ok <th", False),
        ("Ok <b>x</b>", True),
    ],
)
def test_is_conclusive(text, conclusive):
    assert gates.is_conclusive(text) is conclusive


def test_agreement_share_compares_answers_when_both_finished_and_prefixes_while_streaming():
    others = [("Paris.", True), ("paris", True), ("Lyon", True), ("", False)]
    # Two of four agree; the silent one counts against the share but not as a disagreement.
    assert scoring.agreement_share("Paris", True, others, prefix_chars=8) == 0.5
    # While streaming, "The cap" shares its whole length with "The capital is Paris".
    assert scoring.agreement_share("The cap", False, [("The capital is Paris", True)], 8) == 1.0
    assert scoring.agreement_share("The cat", False, [("The capital is Paris", True)], 8) == 0.0
    assert scoring.agreement_share("  ", True, others, prefix_chars=8) == 0.0
    assert scoring.agreement_share("Paris", True, [], prefix_chars=8) == 0.0
