"""The ``judge`` policy's pure pieces: rank complete candidates by confidence, choose the options a
model is asked to pick among, build that model's request and read its choice.

``judge`` is for open-ended answers, where no final answer can be extracted to vote with: every
candidate runs to its end, the complete ones are ranked by confidence (finished on their own
before cut off by ``max_tokens``, passing the gates, then mean token log-probability;
self-certainty would need each step's whole distribution, which workers do not stream), and
when they say different things the strongest model picks one with structured output – an index
into the list, held there by the grammar, so it cannot answer anything else. The chosen
candidate's text is complete, so it goes out at once. How it compares with ``vote`` and
``race`` is measured in ``bench/results/moa-quality.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson

from gateway.moa import gates
from gateway.moa.answers import extract_answer
from gateway.moa.candidates import worker_request
from gateway.moa.scoring import normalize_answer
from gateway.moa.views import WorkerView
from gateway.request import ChatRequest, Message, OutputFormat
from gateway.upstream import ModelInfo

JUDGE = "judge"
JUDGE_MAX_TOKENS = 16  # '{"best": 12}' and its end
INSTRUCTIONS = (
    "You are given several candidate replies to the user's latest message. Some may be wrong. "
    "Pick the reply that is most correct and most consistent with the others. Answer with the "
    "number of that candidate."
)


def confidence(view: WorkerView) -> tuple[bool, bool, float, int]:
    """How much a complete candidate is trusted: ended on its own, passes the gates, mean
    log-probability, length (the sort key, highest first)."""
    logprob = view.mean_logprob
    return (
        view.finish_reason != "length",
        view.verdict() is gates.Verdict.PASS,
        logprob if logprob is not None else -1e9,
        view.tokens,
    )


def most_confident(views: Sequence[WorkerView]) -> WorkerView:
    """The finished text a vote without votes falls back on: text first, then mean
    log-probability, then length."""

    def key(view: WorkerView) -> tuple[bool, float, int]:
        lp = view.mean_logprob
        return (bool(view.text.strip()), lp if lp is not None else -1e9, view.tokens)

    return max(views, key=key)


def _gist(view: WorkerView) -> str:
    """What two candidates must share to count as one option: the final answer when one can be
    extracted, else the normalised text."""
    return extract_answer(view.text) or normalize_answer(view.text)


def options(views: list[WorkerView], limit: int) -> list[WorkerView]:
    """The distinct complete candidates with text, most confident first, at most ``limit``."""
    seen: set[str] = set()
    out: list[WorkerView] = []
    for view in sorted(views, key=confidence, reverse=True):
        gist = _gist(view)
        if not view.text.strip() or gist in seen:
            continue
        seen.add(gist)
        out.append(view)
        if len(out) == limit:
            break
    return out


def choice_schema(count: int) -> dict[str, object]:
    return {
        "type": "object",
        "properties": {"best": {"type": "integer", "enum": list(range(1, count + 1))}},
        "required": ["best"],
        "additionalProperties": False,
    }


def judge_request(request: ChatRequest, texts: list[str], model: ModelInfo) -> ChatRequest:
    """The judge's call: the conversation, the candidates in the system prompt, and a grammar
    that only lets it name one of them (greedy, thinking off)."""
    listing = "\n\n".join(f"Candidate {i}:\n{text.strip()}" for i, text in enumerate(texts, 1))
    instructions = f"{INSTRUCTIONS}\n\n{listing}"
    messages = list(request.messages)
    if messages and messages[0].role == "system":
        instructions = f"{messages.pop(0).content}\n\n{instructions}"
    messages.insert(0, Message(role="system", content=instructions))
    out = worker_request(request, model.id, name=JUDGE)
    return out.model_copy(
        update={
            "messages": messages,
            "tools": [],
            "tool_choice": None,
            "cache_next_turn": False,
            "temperature": 0.0,
            "seed": None,
            "max_tokens": JUDGE_MAX_TOKENS,
            "output_format": OutputFormat(json_schema=choice_schema(len(texts)), name="choice"),
            "reasoning": False,
        }
    )


def read_choice(text: str, count: int) -> int | None:
    """The 0-based option the judge named, or None when its reply names none of them."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    best = value.get("best") if isinstance(value, dict) else None
    if isinstance(best, int) and not isinstance(best, bool) and 1 <= best <= count:
        return best - 1
    return None
