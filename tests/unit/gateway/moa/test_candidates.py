"""Which models ``mesh`` asks: a model without a chat template (a base model) only when there is
no other."""

from __future__ import annotations

from gateway.events import Done, TextDelta
from gateway.moa import MixtureOfAgents, MoaConfig
from gateway.moa.candidates import mixable_models, plan_candidates, plan_samples, plan_single
from gateway.testing import ScriptedUpstream
from gateway.upstream import ModelInfo, StaticDirectory
from gateway.worker_client import worker_body
from tests.unit.gateway.moa.test_splice import ask, assert_well_formed, collect, meta_of, text_of


def chat_and_base() -> tuple[StaticDirectory, ScriptedUpstream, ScriptedUpstream]:
    """SmolLM2 (135M, a chat template) beside gemma3-270m reported without one."""
    smol = ScriptedUpstream.of(TextDelta("Paris."), Done(), name="smol")
    gemma = ScriptedUpstream.of(TextDelta("Paris is the capital of"), Done(), name="gemma")
    directory = StaticDirectory()
    directory.add(
        ModelInfo("smollm2-135m", parameters=135, capabilities={"chat_template": True}), smol
    )
    base = ModelInfo("gemma3-270m", parameters=270, capabilities={"chat_template": False})
    directory.add(base, gemma)
    return directory, smol, gemma


def test_a_base_model_is_no_candidate_beside_a_chat_model():
    directory, _, _ = chat_and_base()
    assert [m.id for m in mixable_models(directory)] == ["smollm2-135m"]
    plan = plan_candidates(directory, ask(), MoaConfig(max_workers=3))
    assert {c.model.id for c in plan} == {"smollm2-135m"} and len(plan) == 3  # self-mixture
    assert {c.model.id for c in plan_samples(directory, ask(), 4)} == {"smollm2-135m"}


def test_unknown_counts_as_chat_and_base_models_alone_still_answer():
    directory = StaticDirectory()
    directory.add(ModelInfo("old", parameters=1), ScriptedUpstream.of(TextDelta("hi")))
    base = ModelInfo("base", parameters=2, capabilities={"chat_template": False})
    directory.add(base, ScriptedUpstream.of(TextDelta("hi")))
    assert [m.id for m in mixable_models(directory)] == ["old"]
    alone = StaticDirectory()
    alone.add(base, ScriptedUpstream.of(TextDelta("hi")))
    assert [m.id for m in mixable_models(alone)] == ["base"]


async def test_race_answers_with_the_chat_model_when_a_base_model_is_beside_it():
    directory, smol, gemma = chat_and_base()
    moa = MixtureOfAgents(directory, MoaConfig(policy="race"))
    events = await collect(moa, ask(metadata={"moa_policy": "race"}))
    assert_well_formed(events)
    assert text_of(events) == "Paris." and meta_of(events)["x-moa-winner"].startswith("smollm2")
    assert gemma.calls == 0 and smol.calls == 3


def test_single_asks_the_best_chat_model_once_greedy_unless_a_temperature_is_set():
    directory, _, _ = chat_and_base()
    (call,) = plan_single(directory, ask())
    assert call.model.id == "smollm2-135m" and call.request.temperature == 0.0
    (call,) = plan_single(directory, ask(temperature=0.9, seed=5))
    assert (call.request.temperature, call.request.seed) == (0.9, 5)
    assert plan_single(StaticDirectory(), ask()) == []


def test_only_the_answer_a_caller_can_continue_has_its_next_turn_prefilled():
    """The worker brings an answer's cache to the next turn's tokens after the response; only
    the caller's own sample (and single's one call) can have a next turn."""
    directory, _, _ = chat_and_base()
    samples = plan_samples(directory, ask(), 4)
    assert [c.request.cache_next_turn for c in samples] == [True, False, False, False]
    mixture = plan_candidates(directory, ask(), MoaConfig(max_workers=3))
    assert [c.request.cache_next_turn for c in mixture] == [True, False, False]
    (call,) = plan_single(directory, ask())
    assert call.request.cache_next_turn
    assert worker_body(samples[1].request, "m")["cache_next_turn"] is False
    assert "cache_next_turn" not in worker_body(samples[0].request, "m")


def test_sample_styles_frame_greedy_samples_or_ask_for_reasoning_first():
    directory, _, _ = chat_and_base()
    framed = plan_samples(directory, ask(), 4, style="framings")
    assert framed[0].request.messages == ask().messages  # the caller's own, as sent
    systems = [c.request.messages[0].content for c in framed[1:]]
    assert len(set(systems)) == 3 and all(c.request.temperature == 0.0 for c in framed)
    reasoned = plan_samples(directory, ask(max_tokens=40), 3, style="reasoning")
    assert all("Answer: <answer>" in c.request.messages[-1].content for c in reasoned)
    assert all(c.request.max_tokens == 192 for c in reasoned)
