"""Consensus among complete samples for open answers (issue 43, item 5): the sample most like the
others, the others weighted by confidence; loops and cut-offs neither win nor weigh."""

from __future__ import annotations

from gateway.events import Done, Error, TextDelta
from gateway.moa import MixtureOfAgents, MoaConfig
from gateway.moa.central import most_central, overlap, words
from gateway.moa.views import WorkerStatus, WorkerView
from gateway.testing import ScriptedUpstream
from gateway.upstream import ModelInfo, StaticDirectory
from tests.unit.gateway.moa.test_splice import ask, collect, meta_of, text_of


def view(name: str, text: str, logprob: float = -0.5, finish: str = "stop") -> WorkerView:
    return WorkerView(
        name,
        started_at=0.0,
        status=WorkerStatus.FINISHED,
        text=text,
        tokens=len(text.split()),
        logprob_sum=logprob,
        logprob_count=1,
        finish_reason=finish,
    )


def test_overlap_is_rouge_1():
    assert overlap(words("the cat sat"), words("The cat sat.")) == 1.0
    assert overlap(words("a b"), words("c d")) == 0.0
    assert overlap(words(""), words("a")) == 0.0


def test_the_sample_most_like_the_others_wins_over_the_most_confident_outlier():
    samples = [
        view("outlier", "Paris is in Italy, near the sea.", logprob=-0.05),
        view("a", "The capital of France is Paris, on the Seine.", logprob=-0.6),
        view("b", "Paris, on the Seine, is the capital of France.", logprob=-0.7),
        view("c", "France's capital is Paris.", logprob=-0.8),
    ]
    chosen = most_central(samples)
    assert chosen is not None and chosen.name in {"a", "b"}


def test_loops_and_cut_offs_neither_win_nor_weigh():
    loop = "the capital the capital " * 30
    samples = [
        view("loop", loop, logprob=-0.01),
        view("cut", "The capital of France is Paris and the", finish="length"),
        view("a", "The capital of France is Paris.", logprob=-0.9),
        view("b", "It is Rome.", logprob=-0.2),
    ]
    chosen = most_central(samples)
    assert chosen is not None and chosen.name == "a"
    only_cut = [view("cut", "Paris and", finish="length"), view("x", "", logprob=-0.1)]
    assert most_central(only_cut).name == "cut"  # type: ignore[union-attr]
    assert most_central([]) is None


def test_two_samples_keep_the_more_confident_one():
    pair = [view("a", "Paris.", logprob=-0.9), view("b", "Lyon.", logprob=-0.1)]
    assert most_central(pair).name == "b"  # type: ignore[union-attr]


def three_models() -> StaticDirectory:
    """Three models, the largest one wrong, the other two saying the same in other words."""
    directory = StaticDirectory()
    texts = {"m1": "Rome is the capital of France.", "m2": "The capital of France is Paris.",
             "m3": "Paris is the capital of France."}  # fmt: skip
    for name, text in texts.items():
        info = ModelInfo(name, parameters=9 if name == "m1" else 1, capabilities={"chat_template": True})  # fmt: skip
        directory.add(info, ScriptedUpstream.of(TextDelta(text), Done(), name=name))
    return directory


async def test_the_judge_policy_selects_by_consensus_when_asked():
    config = MoaConfig(policy="judge", judge_select="consensus", max_workers=3)
    moa = MixtureOfAgents(three_models(), config)
    events = await collect(moa, ask(metadata={"moa_samples": "3"}))
    assert "Paris" in text_of(events) and meta_of(events)["x-moa-decision"] == "consensus"


async def test_a_request_asks_for_consensus_or_gets_an_error_for_an_unknown_selection():
    moa = MixtureOfAgents(three_models(), MoaConfig(max_workers=3))
    asked = {"moa_policy": "judge", "moa_samples": "3", "moa_select": "consensus"}
    events = await collect(moa, ask(metadata=asked))
    assert "Paris" in text_of(events) and meta_of(events)["x-moa-decision"] == "consensus"
    events = await collect(moa, ask(metadata={**asked, "moa_select": "vibes"}))
    errors = [e for _, e in events if isinstance(e, Error)]
    assert errors and errors[0].kind == "invalid_request"
