"""Draft sources for speculative decoding: prompt lookup, or a small model of the same tokenizer.

The verify step (worker/speculative/batch.py) asks each drafting row's :class:`RowDrafter` for up to
K tokens and checks them in one forward pass of the main model; it does not care where they came
from. Prompt lookup (worker/speculative/policy.py) guesses from the row's own context and has no
guess when the suffix never occurred before; a draft model always has one.

The draft model drafts greedily (its argmax at each of K steps): the proposal is then a
deterministic function of the context, the one-hot ``q`` the verify rule already assumes, so
the rejection rule at temperature > 0 stays exact without the draft's probabilities (a sampled
draft would need them). Each row keeps its own KV caches of the draft model; before drafting they
are trimmed back to the longest prefix they share with the row's tokens (the accepted ones) and
fed what is new, so rejected drafts never leave KV behind.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from worker.speculative.policy import NgramIndex

PREFILL_CHUNK = 512  # prompt tokens the draft model takes a forward pass


class RowDrafter(Protocol):
    """One row's drafting state."""

    def ready(self, tokens: Sequence[int]) -> bool:
        """Whether the row, with ``tokens`` so far, will have a draft (asked before the sampled
        token is known, so a row without one does not cost the pipelining a wait)."""
        ...

    def draft(self, tokens: Sequence[int], sampled: int, limit: int) -> list[int]:
        """Up to ``limit`` tokens to follow ``tokens`` + ``sampled``."""
        ...

    def guess(self, tokens: Sequence[int]) -> int | None:
        """The token a draft would start with right after ``tokens``, where knowing it costs
        nothing (a resting row checks its guesses against the tokens that come:
        ``RowPolicy.observe``); None when there is none or it would cost a forward pass."""
        ...


class DraftSource(Protocol):
    def row(self) -> RowDrafter: ...


class PromptLookup:
    """Drafts from the row's own prompt and answer (n-gram match)."""

    def row(self) -> RowDrafter:
        return _LookupRow()


class _LookupRow:
    def __init__(self) -> None:
        self.index = NgramIndex()

    def ready(self, tokens: Sequence[int]) -> bool:
        self.index.sync(tokens)
        return bool(self.index.draft(1))

    def draft(self, tokens: Sequence[int], sampled: int, limit: int) -> list[int]:
        self.index.sync(tokens)
        self.index.extend([sampled])  # fed this step, whatever is accepted
        return self.index.draft(limit)

    def guess(self, tokens: Sequence[int]) -> int | None:
        self.index.sync(tokens)
        found = self.index.draft(1)
        return found[0] if found else None


class DraftModel:
    """A small model that drafts greedily for the main one (same tokenizer).

    ``vocab``: the number of token ids both models' tokenizers share; a padded head's extra
    logits are never proposed (the main model's may be narrower)."""

    def __init__(self, model: Any, vocab: int) -> None:
        self.model = model
        self.vocab = vocab

    def row(self) -> RowDrafter:
        return _ModelRow(self)


class _ModelRow:
    def __init__(self, source: DraftModel) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.source = source
        self.cache = make_prompt_cache(source.model)
        self.fed: list[int] = []  # the tokens whose KV the cache holds, in order

    def ready(self, tokens: Sequence[int]) -> bool:
        return True

    def guess(self, tokens: Sequence[int]) -> int | None:
        return None  # a forward pass of the draft model

    def draft(self, tokens: Sequence[int], sampled: int, limit: int) -> list[int]:
        import mlx.core as mx

        if limit <= 0:
            return []
        context = [*tokens, sampled]
        self._rewind(context)
        logits = None
        new = context[len(self.fed) :]
        for start in range(0, len(new), PREFILL_CHUNK):
            logits = self._forward(new[start : start + PREFILL_CHUNK])
        draft: list[int] = []
        while True:
            assert logits is not None  # the newest token is never in the cache yet
            draft.append(int(mx.argmax(logits[: self.source.vocab]).item()))  # type: ignore[arg-type]
            if len(draft) == limit:
                return draft
            logits = self._forward(draft[-1:])

    def _rewind(self, context: list[int]) -> None:
        """Trim the cache to the longest prefix of ``context`` it holds (drops rejected drafts
        and, the last token, which must be fed again to get its logits)."""
        keep = min(len(self.fed), len(context) - 1)
        for at in range(keep):
            if self.fed[at] != context[at]:
                keep = at
                break
        if keep < len(self.fed):
            for layer in self.cache:
                layer.trim(len(self.fed) - keep)
            del self.fed[keep:]

    def _forward(self, tokens: list[int]) -> Any:
        import mlx.core as mx

        logits = self.source.model(mx.array([tokens]), cache=self.cache)[0, -1]
        self.fed.extend(tokens)
        return logits


def vocabulary_mismatch(main: Any, draft: Any) -> str | None:
    """Why ``draft``'s tokenizer cannot draft for ``main``'s (a sentence), or None."""
    ours, theirs = main.get_vocab(), draft.get_vocab()
    if ours == theirs:
        return None
    if len(ours) != len(theirs):
        return f"the draft model's vocabulary has {len(theirs)} tokens, the model's {len(ours)}"
    token = next(t for t, i in sorted(ours.items(), key=lambda kv: kv[1]) if theirs.get(t) != i)
    return f"the draft model numbers the token {token!r} differently from the model"


def check_draft_dirs(model: str | Path, draft: str | Path) -> str | None:
    """:func:`vocabulary_mismatch` for two local model directories (None when either is not
    one: a hub id is checked when the worker loads it)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    paths = [Path(p).expanduser() for p in (model, draft)]
    if not all(p.is_dir() for p in paths):
        return None
    return vocabulary_mismatch(*(load_tokenizer(p) for p in paths))


def make_draft(path: str, model: Any, draft_tokenizer: Any, tokenizer: Any) -> DraftModel:
    """The draft model loaded from ``path`` for a main model with ``tokenizer`` (raises
    ValueError, in one sentence, when its vocabulary differs or its cache cannot hand back a
    rejected tail)."""
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

    reason = vocabulary_mismatch(tokenizer, draft_tokenizer)
    if reason is not None:
        raise ValueError(f"draft model {path} refused: {reason}")
    if not can_trim_prompt_cache(make_prompt_cache(model)):
        raise ValueError(f"draft model {path} refused: its KV cache cannot be trimmed")
    return DraftModel(model, len(tokenizer.get_vocab()))
