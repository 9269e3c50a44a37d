"""Which worker calls a ``mesh`` request makes, and the aggregator request of the reduce policy.

One call per distinct model reachable (largest models first, capped at ``max_workers``); when the
mesh serves a single model, several samples of it with different temperatures and seeds
(self-mixture), spread over the routes that serve it. Every call carries the caller's thinking
choice, which is *off* unless they opted in (see :mod:`gateway.moa.knobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.moa.config import MoaConfig
from gateway.moa.knobs import thinking_opted_in, with_thinking
from gateway.request import ChatRequest, Message
from gateway.upstream import MESH_MODEL, ModelDirectory, ModelInfo, Upstream

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


def mixable_models(directory: ModelDirectory) -> list[ModelInfo]:
    """Models ``mesh`` can ask: routable, not ``mesh`` itself, largest first (unknown sizes last)."""
    models = [m for m in directory.models() if m.id != MESH_MODEL and directory.routes(m.id)]
    return sorted(models, key=lambda m: -(m.parameters or 0))


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


def plan_candidates(
    directory: ModelDirectory, request: ChatRequest, config: MoaConfig
) -> list[Candidate]:
    """The worker calls for one request (empty when the mesh serves no model)."""
    models = mixable_models(directory)[: config.max_workers]
    if len(models) != 1:
        return [
            Candidate(
                m.id,
                m,
                directory.routes(m.id)[0].upstream,
                worker_request(request, m.id, name=m.id),
            )
            for m in models
        ]
    # Self-mixture: the one model, sampled several times with different temperatures and seeds.
    (model,) = models
    routes = directory.routes(model.id, request.session_key)
    out = []
    for i in range(config.max_workers):
        name = f"{model.id}#{i}" if config.max_workers > 1 else model.id
        sample = worker_request(request, model.id, name=name)
        if i:
            temperature = config.sample_temperatures[i % len(config.sample_temperatures)]
            sample = sample.model_copy(
                update={
                    "temperature": request.temperature if temperature is None else temperature,
                    "seed": (request.seed or 0) + i,
                    # A session key would make samples queue behind each other for affinity.
                    "session_key": f"{request.session_key}/moa{i}" if request.session_key else None,
                }
            )
        out.append(Candidate(name, model, routes[i % len(routes)].upstream, sample))
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
    return out.model_copy(update={"messages": messages})


def plan_samples(directory: ModelDirectory, request: ChatRequest, n: int) -> list[Candidate]:
    """``n`` samples for the vote, spread round-robin over the mesh's models and, per model, its
    routes (nodes). The first is the caller's own request; the others leave temperature, top_p,
    top_k and min_p unset, so each worker samples with its model's recommended values
    (``generation_config``), and get seeds of their own."""
    models = mixable_models(directory)
    if not models:
        return []
    routes = {m.id: directory.routes(m.id, request.session_key) for m in models}
    out = []
    for i in range(n):
        model = models[i % len(models)]
        name = f"{model.id}#{i}" if n > 1 else model.id
        sample = worker_request(request, model.id, name=name)
        if i:
            sample = sample.model_copy(
                update={
                    "temperature": None,
                    "top_p": None,
                    "top_k": None,
                    "min_p": None,
                    "seed": (request.seed or 0) + i,
                    # A session key would make samples queue behind each other for affinity.
                    "session_key": f"{request.session_key}/moa{i}" if request.session_key else None,
                }
            )
        served = routes[model.id]
        upstream = served[(i // len(models)) % len(served)].upstream
        out.append(Candidate(name, model, upstream, sample))
    return out
