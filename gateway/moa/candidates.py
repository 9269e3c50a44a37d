"""Which worker calls a ``mesh`` request makes, and the aggregator request of the reduce policy.

One call per distinct model reachable (largest models first, capped at ``max_workers``); when the
mesh serves a single model, several samples of it with different temperatures and seeds
(self-mixture), spread over the routes that serve it. Every call carries the caller's thinking
choice, which is *off* unless they opted in (see :mod:`gateway.moa.knobs`).

Where a model's calls go: when the directory ranks routes by the prompt (the mesh's ``aroutes``:
cached prefix, load, RTT), :func:`ranked_routes` asks it once per model, with the request as
that model's first call sends it, and the model's calls go to its ranked nodes best first
(more calls than nodes: round again); otherwise the directory's plain order, as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gateway.moa.config import MoaConfig, SampleStyle
from gateway.moa.knobs import thinking_opted_in, with_thinking
from gateway.moa.sample_styles import framed, reasoned
from gateway.moa.track_record import Counts, collapsed, quality_of
from gateway.request import ChatRequest, Message
from gateway.upstream import MESH_MODEL, ModelDirectory, ModelInfo, Route, Upstream

log = logging.getLogger(__name__)

GREEDY = 0.0
# Each model's routes for one request, best first (see :func:`ranked_routes`).
Routes = Mapping[str, list[Route]]

AGGREGATOR_INSTRUCTIONS = (
    "You have been given several candidate responses to the user's latest message, written by "
    "different models. Some may be wrong. Critically evaluate them and write one single, "
    "correct, well-formed answer. Do not mention the candidates or that there were several; "
    "answer the user directly, in the format they asked for."
)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker call: its name in the arbiter, the model behind it and where to send it."""

    name: str
    model: ModelInfo
    upstream: Upstream
    request: ChatRequest
    reason: str | None = None  # why the mesh picked its node (x-mesh-route-reason)


def follows_chat(model: ModelInfo) -> bool:
    """False for a model its worker reports without a chat template (a base model): it
    continues the prompt's text rather than answering the turn. Unknown counts as following."""
    return model.capabilities.get("chat_template") is not False


def mixable_models(
    directory: ModelDirectory, record: Mapping[str, Counts] | None = None
) -> list[ModelInfo]:
    """Models ``mesh`` can ask: routable, not ``mesh`` itself; models without a chat template
    only when no other model is there (gemma3-270m, a base model, beside SmolLM2 cost the vote
    8.7 points and won the race with its text, issue 43). Best first: by measured quality in
    ``record`` (gateway/moa/track_record.py; unmeasured ones at the prior), then largest first
    (unknown sizes last); a pool whose best model is clearly better is that model alone."""
    models = [m for m in directory.models() if m.id != MESH_MODEL and directory.routes(m.id)]
    models = [m for m in models if follows_chat(m)] or models
    record = record or {}
    ranked = sorted(models, key=lambda m: (-quality_of(m.id, record), -(m.parameters or 0)))
    kept = set(collapsed([m.id for m in ranked], record))
    return [m for m in ranked if m.id in kept]


def strongest(models: Sequence[ModelInfo]) -> ModelInfo:
    """The model with the most parameters (the first one when sizes are unknown)."""
    return max(models, key=lambda m: m.parameters or 0)


def worker_request(request: ChatRequest, model: str, *, name: str) -> ChatRequest:
    """The request one worker receives: the caller's, for ``model``, thinking as opted."""
    metadata = {k: v for k, v in request.metadata.items() if not k.startswith("moa_")}
    metadata["moa_worker"] = name
    metadata["logprobs"] = True  # the consensus score uses each delta's mean log-probability
    out = with_thinking(request, thinking_opted_in(request))
    return out.model_copy(update={"model": model, "stream": True, "metadata": metadata})


async def ranked_routes(
    directory: ModelDirectory, request: ChatRequest, models: Sequence[ModelInfo]
) -> dict[str, list[Route]]:
    """Each of ``models``' routes as the directory ranks them for this prompt (its ``aroutes``,
    asked with the request the model's first call sends: same messages, same thinking); a
    model it does not rank (one node, routing mode ``today``, no ranking at all) is left out,
    for the plain order."""
    ranker = getattr(directory, "aroutes", None)
    if ranker is None or not models:
        return {}

    async def rank(model: ModelInfo) -> list[Route]:
        try:
            return list(await ranker(worker_request(request, model.id, name=model.id)))
        except Exception as exc:  # a ranking that fails costs the cache hits, not the answer
            log.warning("ranking routes for %s failed: %r", model.id, exc)
            return []

    ranked = await asyncio.gather(*(rank(m) for m in models))
    return {m.id: routes for m, routes in zip(models, ranked, strict=True) if routes}


def _routes_of(
    directory: ModelDirectory, routes: Routes | None, model: str, session_key: str | None
) -> list[Route]:
    return (routes or {}).get(model) or directory.routes(model, session_key)


def _candidate(name: str, model: ModelInfo, route: Route, request: ChatRequest) -> Candidate:
    return Candidate(name, model, route.upstream, request, route.reason)


def plan_candidates(
    directory: ModelDirectory,
    request: ChatRequest,
    config: MoaConfig,
    routes: Routes | None = None,
    pool: Sequence[ModelInfo] | None = None,
) -> list[Candidate]:
    """The worker calls for one request (empty when the mesh serves no model); ``routes``: the
    ranked routes of :func:`ranked_routes`, for the models it ranked; ``pool``: the models
    :func:`mixable_models` gives (with the track record), when the caller has them."""
    models = list(mixable_models(directory) if pool is None else pool)[: config.max_workers]
    if len(models) != 1:
        return [
            _candidate(
                m.id,
                m,
                _routes_of(directory, routes, m.id, None)[0],
                worker_request(request, m.id, name=m.id),
            )
            for m in models
        ]
    # Self-mixture: the one model, sampled several times with different temperatures and seeds.
    (model,) = models
    served = _routes_of(directory, routes, model.id, request.session_key)
    out = []
    for i in range(config.max_workers):
        name = f"{model.id}#{i}" if config.max_workers > 1 else model.id
        sample = worker_request(request, model.id, name=name)
        if i:
            temperature = config.sample_temperatures[i % len(config.sample_temperatures)]
            sample = sample.model_copy(
                update={
                    "cache_next_turn": False,
                    "temperature": request.temperature if temperature is None else temperature,
                    "seed": (request.seed or 0) + i,
                    # A session key would make samples queue behind each other for affinity.
                    "session_key": f"{request.session_key}/moa{i}" if request.session_key else None,
                }
            )
        out.append(_candidate(name, model, served[i % len(served)], sample))
    return out


def reducer_request(
    request: ChatRequest, answers: Sequence[tuple[str, str]], model: ModelInfo
) -> ChatRequest:
    """The aggregator call: the conversation, plus the candidates in the system prompt."""
    listing = "\n\n".join(
        f"Response {i}:\n{text.strip()}" for i, (_, text) in enumerate(answers, 1)
    )
    instructions = f"{AGGREGATOR_INSTRUCTIONS}\n\n{listing}"
    messages = list(request.messages)
    if messages and messages[0].role == "system":
        head = messages.pop(0)
        instructions = f"{head.content}\n\n{instructions}"
    messages.insert(0, Message(role="system", content=instructions))
    out = worker_request(request, model.id, name="reducer")
    return out.model_copy(update={"messages": messages, "cache_next_turn": False})


def plan_samples(
    directory: ModelDirectory,
    request: ChatRequest,
    n: int,
    routes: Routes | None = None,
    min_temperature: float | None = None,
    style: SampleStyle = "temperature",
    pool: Sequence[ModelInfo] | None = None,
) -> list[Candidate]:
    """``n`` samples for the vote, spread round-robin over the mesh's models and, per model, its
    routes (nodes; ``routes``: the ranked ones, best first). The first is the caller's own
    request (greedy when it leaves temperature unset); the others leave temperature, top_p, top_k and min_p unset, so each worker samples
    with its model's recommended values (``generation_config``) – its temperature no lower than
    ``min_temperature`` (the worker's ``min_temperature`` field) – and get seeds of their own;
    ``style``: how else they differ (gateway/moa/sample_styles.py); ``pool`` as in
    :func:`plan_candidates`."""
    models = list(mixable_models(directory) if pool is None else pool)
    if not models:
        return []
    by_model = {m.id: _routes_of(directory, routes, m.id, request.session_key) for m in models}
    out = []
    for i in range(n):
        model = models[i % len(models)]
        name = f"{model.id}#{i}" if n > 1 else model.id
        sample = worker_request(request, model.id, name=name)
        if not i and request.temperature is None:
            # The caller's own sample wins ties and scattered votes: greedy when they left
            # temperature unset (SmolLM2's own 0.2 was 4.9 points below greedy, issue 43).
            sample = sample.model_copy(update={"temperature": GREEDY})
        if i:
            sample = sample.model_copy(
                update={
                    "cache_next_turn": False,
                    "temperature": None,
                    "min_temperature": min_temperature,
                    "top_p": None,
                    "top_k": None,
                    "min_p": None,
                    "seed": (request.seed or 0) + i,
                    # A session key would make samples queue behind each other for affinity.
                    "session_key": f"{request.session_key}/moa{i}" if request.session_key else None,
                }
            )
        if style == "framings" and i:
            sample = framed(sample, i)
        elif style == "reasoning":
            sample = reasoned(sample)
        served = by_model[model.id]
        out.append(_candidate(name, model, served[(i // len(models)) % len(served)], sample))
    return out


def plan_single(
    directory: ModelDirectory,
    request: ChatRequest,
    routes: Routes | None = None,
    pool: Sequence[ModelInfo] | None = None,
) -> list[Candidate]:
    """The ``single`` policy's one call: the best model (the first :func:`mixable_models`
    orders), on its best route, with the caller's request – greedy when it leaves temperature
    unset, as the vote's own sample is; ``pool`` as in :func:`plan_candidates`."""
    models = list(mixable_models(directory) if pool is None else pool)
    if not models:
        return []
    model = models[0]
    sample = worker_request(request, model.id, name=model.id)
    if request.temperature is None:
        sample = sample.model_copy(update={"temperature": GREEDY})
    route = _routes_of(directory, routes, model.id, request.session_key)[0]
    return [_candidate(model.id, model, route, sample)]
