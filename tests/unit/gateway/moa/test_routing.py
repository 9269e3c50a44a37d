"""``model="mesh"`` with a directory that ranks routes by the prompt (the mesh's cache-aware
``aroutes``): each model is ranked once, with its first call's request, and its calls go to the
ranked nodes best first; without a ranking, the plain order as before."""

from __future__ import annotations

from gateway.events import Done, Meta, TextDelta
from gateway.moa import MixtureOfAgents, MoaConfig
from gateway.moa.candidates import plan_candidates, plan_samples, ranked_routes
from gateway.request import ChatRequest
from gateway.testing import RankedDirectory, ScriptedUpstream
from gateway.upstream import ModelInfo, Route
from tests.unit.gateway.moa.test_splice import ask, assert_well_formed, collect

VOTE = MoaConfig(first_token_timeout_s=5.0, total_timeout_s=20.0, vote_wave=32)


def node(name: str) -> ScriptedUpstream:
    return ScriptedUpstream.of(TextDelta("12"), Done(), name=name)


def served(model: str, nodes: list[ScriptedUpstream], params: int = 1) -> RankedDirectory:
    """``model`` on ``nodes``, in that plain order, nothing ranked yet."""
    directory = RankedDirectory()
    for upstream in nodes:
        directory.add(ModelInfo(model, parameters=params), upstream, kind="peer")
    return directory


def ranked(*pairs: tuple[ScriptedUpstream, str]) -> list[Route]:
    return [Route(upstream=u, kind="peer", peer=u.name, reason=why) for u, why in pairs]


def merged(events) -> dict[str, str]:
    return {k: v for _, e in events if isinstance(e, Meta) for k, v in e.headers.items()}


def sent_to(candidates) -> list[str]:
    return [c.upstream.name for c in candidates]


async def test_vote_samples_go_to_the_ranked_nodes_best_first_and_wrap():
    a, b, c = node("a"), node("b"), node("c")
    directory = served("m", [a, b, c])
    directory.ranked["m"] = ranked((c, "cache 512/600"), (a, "load"), (b, "load"))
    request = ask(metadata={"moa_policy": "vote", "moa_samples": "4"}, session_key="s1")
    events = await collect(MixtureOfAgents(directory, VOTE), request)
    assert_well_formed(events)
    # Asked once for the one model, with the request its first sample sends.
    (asked,) = directory.asked
    assert asked.model == "m" and asked.session_key == "s1" and asked.messages == request.messages
    assert (c.calls, a.calls, b.calls) == (2, 1, 1)
    assert c.requests[0].seed == request.seed  # the caller's own sample, on the cached node
    headers = merged(events)
    assert headers["x-moa-routes"] == "m#0=cache 512/600, m#1=load, m#2=load, m#3=cache 512/600"
    winner_reason = dict(p.split("=") for p in headers["x-moa-routes"].split(", "))
    assert headers["x-mesh-route-reason"] == winner_reason[headers["x-moa-winner"]]


async def test_without_a_ranking_samples_keep_the_plain_round_robin():
    a, b, c = node("a"), node("b"), node("c")
    directory = served("m", [a, b, c])  # ranks nothing: one node, or routing mode "today"
    plan = plan_samples(directory, ask(), 4, await ranked_routes(directory, ask(), [_m()]))
    assert sent_to(plan) == ["a", "b", "c", "a"]
    assert all(c.reason is None for c in plan)
    events = await collect(
        MixtureOfAgents(directory, VOTE), ask(metadata={"moa_policy": "vote", "moa_samples": "4"})
    )
    assert "x-moa-routes" not in merged(events) and "x-mesh-route-reason" not in merged(events)


async def test_each_model_is_ranked_with_its_own_request():
    big_a, big_b, small_a, small_b = node("big-a"), node("big-b"), node("small-a"), node("small-b")
    directory = served("big", [big_a, big_b], params=9)
    for upstream in (small_a, small_b):
        directory.add(ModelInfo("small", parameters=1), upstream, kind="peer")
    directory.ranked["big"] = ranked((big_b, "cache 64/80"), (big_a, "load"))
    directory.ranked["small"] = ranked((small_b, "sticky"), (small_a, "load"))
    models = list(directory.models())
    routes = await ranked_routes(directory, ask(), models)
    assert sorted(r.model for r in directory.asked) == ["big", "small"]
    # One call per model (race/reduce): each on its model's best node.
    plan = plan_candidates(directory, ask(), MoaConfig(max_workers=2), routes)
    assert sent_to(plan) == ["big-b", "small-b"]
    assert [c.reason for c in plan] == ["cache 64/80", "sticky"]
    # The vote: round robin over the models, and per model over its ranked nodes.
    plan = plan_samples(directory, ask(), 5, routes)
    assert sent_to(plan) == ["big-b", "small-b", "big-a", "small-a", "big-b"]


async def test_self_mixture_spreads_over_the_ranked_nodes():
    a, b = node("a"), node("b")
    directory = served("m", [a, b])
    directory.ranked["m"] = ranked((b, "cache 32/40"), (a, "load"))
    config = MoaConfig(max_workers=3)
    routes = await ranked_routes(directory, ask(), list(directory.models()))
    assert sent_to(plan_candidates(directory, ask(), config, routes)) == ["b", "a", "b"]
    assert sent_to(plan_candidates(directory, ask(), config)) == ["a", "b", "a"]


async def test_a_ranking_that_fails_leaves_the_plain_order():
    a, b = node("a"), node("b")

    class Broken(RankedDirectory):
        async def aroutes(self, request: ChatRequest) -> list[Route]:
            raise RuntimeError("tokenizer went away")

    directory = Broken()
    for upstream in (a, b):
        directory.add(_m(), upstream, kind="peer")
    events = await collect(
        MixtureOfAgents(directory, VOTE), ask(metadata={"moa_policy": "vote", "moa_samples": "2"})
    )
    assert_well_formed(events)
    assert (a.calls, b.calls) == (1, 1)


def _m() -> ModelInfo:
    return ModelInfo("m", parameters=1)
