"""A generated token's log-probability, and the most likely tokens at its position, read from the
distribution its step sampled from (mlx-lm's ``logprobs`` vector: after the logits processors,
before the temperature). A speculative step hands each token the vector of its own position
(worker/speculative/batch.py), so both read the same numbers."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from worker.engine.types import TokenLogprob


def token_logprob(token: int, logprobs: mx.array, top: int, tokenizer: Any) -> TokenLogprob:
    """``token``'s entry; with ``top`` > 0 also that many of the likeliest tokens, most likely
    first (equal ones by id, so the order does not depend on how the top was found). A token a
    logits processor ruled out (a grammar's mask: -inf) is no alternative."""
    chosen = float(logprobs[token].item())
    alternatives: tuple[tuple[str, float], ...] = ()
    if top > 0:
        top = min(top, logprobs.shape[-1])
        ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
        values = logprobs[ids].astype(mx.float32)
        ranked = sorted(
            zip(ids.tolist(), values.tolist(), strict=True), key=lambda p: (-p[1], p[0])
        )
        alternatives = tuple(
            (tokenizer.decode([i]), float(v)) for i, v in ranked if math.isfinite(v)
        )
    return TokenLogprob(tokenizer.decode([token]), chosen, alternatives)
