"""Which running job a new prompt takes its prefill from: the pure rule the engine applies.

The samples of one prompt (``model="mesh"``'s self-mixture, Chat ``n > 1``) and agents that share
a system prompt arrive together with the same (or a prefix-shared) prompt. Prefilling each of them
computes the same KV again, and on one engine they share its cores: three samples took 2-3x the
TTFT of one. Instead a new job whose prompt shares more with a job already running than the
prompt cache offers waits until that job's cache holds the shared part (a *source*), then starts
from a copy of it and runs only the rest. An identical prompt then runs one token of its own (the
last, which starts decoding) and joins its source's next decode step.

Waiting is only worth it when the shared part is most of the new job's work: a job that could
save 10 tokens by waiting for another's 512-token chunk does its own prefill instead. A source
that already holds the shared part costs no wait, so then any gain is taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.prompt_cache.digest import common_prefix


@dataclass(frozen=True, slots=True)
class Source:
    """A running job as a possible source: its prompt and how much of it its cache holds now."""

    key: int
    prompt: Sequence[int]
    held: int


@dataclass(frozen=True, slots=True)
class Share:
    """The plan for a new job: take the first ``tokens`` of its prompt from source ``key``."""

    key: int
    tokens: int
    ready: bool  # the source holds them already: fork now, no wait


@dataclass(frozen=True, slots=True)
class SharePolicy:
    """When waiting for a source pays (see the module docstring)."""

    min_tokens: int = 16  # fewer shared tokens than this are not worth a wait
    min_share: float = 0.5  # ... nor a share of the job's own prefill below this


def shared_tokens(source_prompt: Sequence[int], prompt: Sequence[int]) -> int:
    """Prompt tokens a source's KV can serve: the common prefix, at least one token left to run
    (the last prompt token's logits start the answer)."""
    return max(0, min(common_prefix(source_prompt, prompt), len(prompt) - 1))


def plan_share(
    prompt: Sequence[int],
    sources: Sequence[Source],
    *,
    cached: int,
    policy: SharePolicy = SharePolicy(),
) -> Share | None:
    """The best source for ``prompt`` (the most shared tokens, then the furthest along), or None
    when none beats the ``cached`` tokens the prompt cache serves by enough to be worth it."""
    own_work = len(prompt) - cached
    best: Share | None = None
    best_rank = (0, 0)
    for source in sources:
        tokens = shared_tokens(source.prompt, prompt)
        gain = tokens - cached
        if gain <= 0:
            continue
        ready = source.held >= tokens
        if not ready and (gain < policy.min_tokens or gain < policy.min_share * own_work):
            continue
        rank = (tokens, min(source.held, tokens))
        if rank > best_rank:
            best, best_rank = Share(source.key, tokens, ready), rank
    return best
