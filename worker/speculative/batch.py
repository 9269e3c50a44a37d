"""Speculative decoding inside continuous batching: rows draft, and one forward pass verifies.

mlx-lm's ``GenerationBatch`` feeds each row's sampled token through the model to sample the
next one. :class:`SpeculativeBatch` takes its place in the ``BatchGenerator``: when some row's
context predicts what comes next (prompt lookup, worker/speculative/policy.py), the step feeds each row
its sampled token *and* its drafted tokens (a prefill of up to K+1 tokens a row, rows without a
draft padded), then accepts each draft as far as the model agrees: at temperature 0 while the
argmax equals the draft, above it while each position's draw (with the key plain decoding
would use there) equals the draft – so the tokens are the ones decoding would give, seeded or
greedy, and follow the same distribution (Leviathan et al. 2023's rule for a certain
proposal). A row that
accepted n drafts emits n+1 tokens and keeps their KV only; rows trim independently: every
row drops what all rejected (``trim``), and what a row rejected beyond that stays in place as
masked holes (worker/speculative/holes.py: rolling it out moved the row's whole history, more than a
decode step's time). Sliding windows and a split group's recorded caches roll it into the
row's left padding instead (``prepare(right_padding)`` + ``finalize``, as mlx-lm pads a
prefill): the batch cache's own operations, which a split group's followers replay
(worker/split/cache.py) like any other.

Rows run the plain step (with its asynchronous pipelining) whenever no row has a draft, or
when the drafts are not worth their verify pass: each step the drafts are cut to the width
that gives the most tokens for its time (``_plan``: rows' recent acceptance against the batch's
own timing of its steps, worker/speculative/policy.py). A row
drafts only when speculation is on, the batch is small enough that decode is bandwidth-bound
(``max_rows``), its logits processors can see drafted positions and give refused ones back
(``DraftAwareProcessor``: a grammar's matcher, which also cuts a draft where the grammar
refuses it; penalties and logit bias, which read the context only), its sampler is the
engine's own (greedy or :class:`~worker.sampling.RequestSampler`), its caches can hand a
rejected tail back (``BatchKVCache``, or a sliding window's ``BatchRotatingKVCache`` outside a
split group: see ``trim_window`` in worker/speculative/cache_ops.py) and its acceptance holds up
(:class:`~worker.speculative.policy.RowPolicy`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from worker.mlx_lm_hooks import (
    generation_batch_class,
    install_generation_batch,
    prompt_tokens_counter,
    write_index,
)
from worker.sampling import DraftAwareProcessor, RequestSampler, greedy
from worker.speculative.cache_ops import can_trim, in_order, trim_rows
from worker.speculative.drafts import DraftSource, PromptLookup, RowDrafter
from worker.speculative.holes import Holes
from worker.speculative.policy import RowPolicy, Speculation, StepCosts, best_width


@dataclass
class SpeculationStats:
    """What speculation did since start (read by /health and /metrics)."""

    verify_steps: int = 0  # forward passes that checked drafts
    drafted: int = 0  # tokens proposed
    accepted: int = 0  # of those, tokens the model agreed with
    emitted: int = 0  # tokens the verify passes gave their rows (accepted + one per row)
    row_steps: int = 0  # (row, verify pass) pairs
    empty_drafts: int = 0  # rows whose context matched but whose draft came out empty
    declined: int = 0  # steps with drafts that a plain step was expected to beat
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, drafted: int, accepted: int, emitted: int, rows: int) -> None:
        with self._lock:
            self.verify_steps += 1
            self.drafted += drafted
            self.accepted += accepted
            self.emitted += emitted
            self.row_steps += rows

    def add_empty(self, rows: int) -> None:
        with self._lock:
            self.empty_drafts += rows

    def add_declined(self) -> None:
        with self._lock:
            self.declined += 1

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            rate = self.accepted / self.drafted if self.drafted else None
            per_step = self.emitted / self.row_steps if self.row_steps else None
            return {
                "verify_steps": self.verify_steps,
                "drafted": self.drafted,
                "accepted": self.accepted,
                "acceptance_rate": None if rate is None else round(rate, 4),
                "tokens_per_step": None if per_step is None else round(per_step, 4),
                "empty_drafts": self.empty_drafts,
                "declined": self.declined,
            }


# Refused draft tokens an empty draft counts as in a row's policy: a verify pass of 9 tokens
# costs ~2 plain steps (bench/results/speculative.md: ~0.12 of a step a refused token), a lost
# pipelining ~0.25 (the forward graph's Python is a quarter of the engine thread: worker.md).
EMPTY_DRAFT_COST = 2
EXPLORE_AFTER = 32  # declined steps before one decision goes on the prior slope again


@dataclass
class _Row:
    drafter: RowDrafter
    policy: RowPolicy
    # While the row rests: (its context's length, the token its drafter guessed would follow).
    guessed: tuple[int, int] | None = None


# mlx-lm's batch, whose private per-row state this one reads and writes (worker/mlx_lm_hooks.py).
_GenerationBatch: Any = generation_batch_class()


class SpeculativeBatch(_GenerationBatch):  # type: ignore[misc]
    """mlx-lm's generation batch, stepping by verified drafts where rows have them."""

    speculation: Speculation
    spec_stats: SpeculationStats
    source: DraftSource
    _rows: list[_Row]
    costs: StepCosts  # what plain steps and verify passes cost here (decides the width)
    prompt_tokens: Callable[[], int]  # the generator's prefilled tokens so far
    # The step under way, to be timed when the next begins: (kind, rows, width, start,
    # prompt tokens at its start); None when it is not one to learn from.
    _clocked: tuple[str, int, int, float, int] | None
    _steady: int  # plain steps in a row without a sync
    _declines: int  # declined steps since a decision last went on the prior
    _holes: Holes  # rejected positions left masked in the cache (worker/speculative/holes.py)

    @classmethod
    def make(
        cls,
        model: Any,
        fallback_sampler: Any,
        speculation: Speculation,
        stats: SpeculationStats,
        source: DraftSource,
    ) -> SpeculativeBatch:
        batch: SpeculativeBatch = cls.empty(model, fallback_sampler)
        batch.speculation = speculation
        batch.spec_stats = stats
        batch.source = source
        batch._rows = []
        batch.costs = StepCosts(fixed=speculation.slope)
        batch.prompt_tokens = lambda: 0
        batch._clocked = None
        batch._steady = 0
        batch._declines = 0
        batch._holes = Holes()
        return batch

    def extend(self, batch: Any) -> None:
        before = write_index(self.prompt_cache[0]) if self.prompt_cache else 0
        other_before = write_index(batch.prompt_cache[0]) if batch.prompt_cache else 0
        super().extend(batch)
        if self.prompt_cache:
            self._holes.extend(
                self.prompt_cache, before, getattr(batch, "_holes", None), other_before
            )
        rows = getattr(batch, "_rows", None)
        wake_hits = self.speculation.wake_hits
        self._rows.extend(
            rows or [_Row(self.source.row(), RowPolicy(wake_hits=wake_hits)) for _ in batch.uids]
        )
        self._clocked = None  # the joining rows' first pass ran inside this period
        self._steady = 0

    def filter(self, keep: list[int]) -> None:
        self._holes.filter(self.prompt_cache, keep)
        super().filter(keep)
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._clocked = None  # idle from here: the time until rows come is no step's

    def extract_cache(self, idx: int) -> list[Any]:
        return self._holes.extract(self.prompt_cache, idx) or super().extract_cache(idx)

    def next(self) -> list[Any]:
        if not self.uids:
            self._clocked = None  # idle from here: the time until rows come is no step's
            return []
        # Until plain steps at this batch size are timed, the batch takes them (a few steps
        # once per size; which steps draft never changes an answer).
        eligible = [] if self.costs.needs_plain(len(self.uids)) else self._eligible()
        limits = self._plan(eligible)
        eligible = [i for i in eligible if limits[i]]
        self._clock(synced=bool(eligible))
        if not eligible:
            self._steady += 1
            self._start_clock("plain", 1)
            return super().next()  # type: ignore[no-any-return]
        self._steady = 0
        # The wait for the previous step's tokens is that step's compute, not this step's.
        mx.eval(self._next_tokens)
        started = time.perf_counter()
        sampled = [int(t) for t in self._next_tokens.tolist()]
        drafts: list[list[int]] = [[] for _ in self.uids]
        for i in eligible:
            draft = self._rows[i].drafter.draft(self.tokens[i], sampled[i], limits[i])
            for processor in self.logits_processors[i]:
                draft = draft[: processor.draft_limit([sampled[i]], draft)]
            drafts[i] = draft
        self._count_empty([i for i in eligible if not drafts[i]])
        if not any(drafts):
            return super().next()  # type: ignore[no-any-return]
        self._start_clock("verify", 1 + max(len(d) for d in drafts), started)
        return self._verify(sampled, drafts)

    def _clock(self, synced: bool) -> None:
        """Time the step that just ended (from its start to this one's) into the costs, unless
        a prefill chunk ran in between. A plain step counts only in a steady run of them (the
        pipeline refills over the first two after a sync, one period short and one long) and
        not when this step is about to wait for its tokens (its compute is not over)."""
        now, prompt = time.perf_counter(), self.prompt_tokens()
        if self._clocked is not None:
            kind, rows, width, start, before = self._clocked
            if prompt == before and rows == len(self.uids):
                if kind == "verify":
                    self.costs.verify(rows, width, now - start)
                elif self._steady >= 2 and not synced:
                    self.costs.plain(rows, now - start)
        self._clocked = None

    def _start_clock(self, kind: str, width: int, started: float | None = None) -> None:
        started = time.perf_counter() if started is None else started
        self._clocked = (kind, len(self.uids), width, started, self.prompt_tokens())

    def _plan(self, eligible: list[int]) -> list[int]:
        """How many tokens each row drafts this step: the width that gives the batch the most
        tokens for its time if each eligible row drafted all it may (``best_width``: each row's
        recent acceptance against what a drafted position costs here), 0 for all when a plain
        step gives more – decided before drafting, which costs a draft model its own passes.
        Which width is chosen never changes an answer, only its speed (seeded draws are keyed
        by position: ``_accept_sampled``)."""
        limits = [0] * len(self.uids)
        for i in eligible:
            room = self.max_tokens[i] - self._num_tokens[i] - 1
            limits[i] = min(self.speculation.draft_tokens, room)
        if not eligible:
            return limits
        rates = [row.policy.rate for row in self._rows]
        # A declined draft is never timed: after EXPLORE_AFTER declines, one decision on the
        # prior, so that a slope that once came out high gets measured again.
        explore = self._declines >= EXPLORE_AFTER
        if explore:
            overhead, slope = self.costs.prior_overhead, self.costs.prior_slope
        else:
            overhead, slope = self.costs.model(len(self.uids))
        self._declines = 0 if explore else self._declines
        width = best_width(limits, rates, slope, overhead)
        if width == 1:
            for i in eligible:
                self._rows[i].policy.skip()
            self.spec_stats.add_declined()
            self._declines += 1
        return [min(n, width - 1) for n in limits]

    def _count_empty(self, rows: list[int]) -> None:
        """A row whose context matched but whose draft came out empty (the sampled token broke
        the match) cost the step its pipelining, a sync on the sampled tokens: a quarter of a
        step or so, as much as two refused draft tokens, so its policy counts it as those."""
        for i in rows:
            self._rows[i].policy.miss(EMPTY_DRAFT_COST)
        if rows:
            self.spec_stats.add_empty(len(rows))

    def _eligible(self) -> list[int]:
        """The rows that may draft this step and whose context has a match (checked before
        the sampled token is known, which would cost the pipelining a wait)."""
        if len(self.uids) > self.speculation.max_rows:
            return []
        if not can_trim(self.prompt_cache):
            return []
        if 0 in self._num_tokens:
            # A row that just joined holds its first token (its prefill's): a plain step hands
            # it out at once (its pipelining returns it while the next step runs), a verify
            # pass would hold it back – and the time to first token – for a whole pass.
            return []
        rows = []
        for i, row in enumerate(self._rows):
            # A logits processor must be able to see each drafted position with its own
            # context and give back refused drafts (a grammar's matcher; penalties and logit
            # bias read the context only); any other processor's row decodes a token a step.
            if not all(isinstance(p, DraftAwareProcessor) for p in self.logits_processors[i]):
                continue
            sampler = self.samplers[i] if self.samplers else None
            if not (sampler is greedy or isinstance(sampler, RequestSampler)):
                continue
            if row.policy.resting and row.policy.wake_hits:
                _check_guess(row, self.tokens[i])
            if self.max_tokens[i] - self._num_tokens[i] < 2 or not row.policy.may_draft():
                continue
            if row.drafter.ready(self.tokens[i]):
                rows.append(i)
        return rows

    def _verify(self, sampled: list[int], drafts: list[list[int]]) -> list[Any]:
        width = 1 + max(len(d) for d in drafts)
        inputs = mx.array(
            [[t, *d, *([t] * (width - 1 - len(d)))] for t, d in zip(sampled, drafts, strict=True)]
        )
        in_order(self.prompt_cache)
        logits = self.model(inputs, cache=self.prompt_cache)
        logits = self._process(logits, inputs, drafts)
        # Normalised per row and position, lazily: only what is read gets its exp (MLX's CPU
        # exp is single-threaded; rows x width x vocabulary of it cost a 4-row pass of 9 tokens
        # on gemma3's 262k vocabulary more than its forward pass). Greedy acceptance needs the
        # argmax only; the next step reads each row's following position; a row that samples,
        # its drafted positions; a token's vector, the client that asked for logprobs.
        accepted, following = self._accept(logits, drafts)
        emitted = [[t, *d[:n]] for t, d, n in zip(sampled, drafts, accepted, strict=True)]
        # Each emitted token's distribution: the sampled one's from the step before, a draft's
        # from the position before it.
        vectors = [
            [self._next_logprobs[i], *(_normalised(logits[i, j]) for j in range(n))]
            for i, n in enumerate(accepted)
        ]
        finish = self._finishes(emitted)
        kept = [len(e) for e in emitted]  # cut at a finish: tokens after it are not the answer
        trim_rows(self.prompt_cache, [width - k for k in kept], self._holes)
        for i, tokens in enumerate(emitted):
            self.tokens[i].extend(tokens)
            if self.logits_processors[i]:
                # What was fed and kept: the sampled token and the accepted drafts (the
                # following token is fed next step, as after a plain one).
                self._token_context[i].update_and_fetch(inputs[i, : accepted[i] + 1])
                if drafts[i]:  # only rows whose processors are all draft-aware have drafts
                    for processor in self.logits_processors[i]:
                        processor.rollback(len(drafts[i]) - accepted[i])
        self._next_tokens = mx.array(following, dtype=mx.uint32)
        self._next_logprobs = [_normalised(logits[i, n]) for i, n in enumerate(accepted)]
        self._current_tokens = mx.array(sampled, dtype=mx.uint32)
        drafted = [len(d) for d in drafts]
        for row, d, n in zip(self._rows, drafted, accepted, strict=True):
            if d:
                row.policy.record(d, n)
        self.spec_stats.add(sum(drafted), sum(accepted), sum(kept), len(kept))
        return self._responses(emitted, vectors, finish)

    def _process(self, logits: mx.array, inputs: mx.array, drafts: list[list[int]]) -> mx.array:
        """Rows with logits processors run them on each of their real positions (the sampled
        token's, then each drafted one's), in order, with the context plain decoding would give
        that position had the drafts before it been sampled: a grammar's matcher consumes the
        drafts one by one (``_verify`` gives back the refused ones), penalties see them."""
        if not any(self.logits_processors):
            return logits
        rows = []
        for e, processors in enumerate(self.logits_processors):
            row = logits[e]
            if processors:
                before = self._token_context[e].tokens
                fed = inputs[e, : len(drafts[e]) + 1].astype(before.dtype)
                positions = []
                for j in range(fed.size):
                    context = mx.concatenate([before, fed[: j + 1]])
                    position = row[j : j + 1]
                    for processor in processors:
                        position = processor(context, position)
                    positions.append(position)
                row = mx.concatenate([*positions, row[fed.size :]], axis=0)
            rows.append(row[None])
        return mx.concatenate(rows, axis=0)

    def _accept(self, logits: mx.array, drafts: list[list[int]]) -> tuple[list[int], list[int]]:
        """Per row: how many drafted tokens stand, and the token that follows them."""
        best = mx.argmax(logits, axis=-1)  # the logprobs' argmax, without their exp
        mx.eval(best)
        best_rows = best.tolist()
        accepted, following = [], []
        for i, draft in enumerate(drafts):
            sampler = self.samplers[i] if self.samplers else None
            if isinstance(sampler, RequestSampler):
                n, token = _accept_sampled(sampler, _normalised(logits[i, : len(draft) + 1]), draft)
            else:
                n = 0
                while n < len(draft) and best_rows[i][n] == draft[n]:
                    n += 1
                if sampler is greedy or not self.samplers:
                    token = best_rows[i][n]
                else:  # a row that did not draft, with a sampler of its own
                    token = int(sampler(_normalised(logits[i, :1])).item())
            accepted.append(n)
            following.append(token)
        return accepted, following

    def _finishes(self, emitted: list[list[int]]) -> list[str | None]:
        """Run each emitted token through the length limit and the end sequences, as the plain
        step does; a row that finishes has its tokens after that one cut off."""
        finish: list[str | None] = []
        for i, tokens in enumerate(emitted):
            reason = None
            for at, token in enumerate(tokens):
                self._num_tokens[i] += 1
                if self._num_tokens[i] >= self.max_tokens[i]:
                    reason = "length"
                if self._matchers[i].advance(token):
                    reason = "stop"
                if reason is not None:
                    del tokens[at + 1 :]
                    break
            finish.append(reason)
        return finish

    def _responses(
        self, emitted: list[list[int]], vectors: list[list[mx.array]], finish: list[str | None]
    ) -> list[Any]:
        responses, keep = [], []
        for i, tokens in enumerate(emitted):
            last = len(tokens) - 1
            for at, token in enumerate(tokens):
                done = finish[i] if at == last else None
                responses.append(
                    self.Response(
                        uid=self.uids[i],
                        token=token,
                        logprobs=vectors[i][at],
                        finish_reason=done,
                        prompt_cache=self.extract_cache(i) if done else None,
                        all_tokens=self.tokens[i] if done else None,
                    )
                )
            if finish[i] is None:
                keep.append(i)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses


def _check_guess(row: _Row, tokens: list[int]) -> None:
    """A resting row's free check: whether the token that came after its last guess is the
    one guessed (``RowPolicy.observe``, which ends the rest after a few in a row), then the
    guess for the next one. A guess is checked only against the very next token."""
    if row.guessed is not None and len(tokens) == row.guessed[0] + 1:
        row.policy.observe(tokens[-1] == row.guessed[1])
    guess = row.drafter.guess(tokens) if row.policy.resting else None
    row.guessed = None if guess is None else (len(tokens), guess)


def _accept_sampled(
    sampler: RequestSampler, logprobs: mx.array, draft: list[int]
) -> tuple[int, int]:
    """A draft that proposed each token with certainty (prompt lookup, a greedy draft model)
    checked by sampling: draw each position's token from p with the key plain decoding would
    draw it with, and keep the drafted tokens while they equal the draws. Each emitted token is
    then p's draw at its position – Leviathan et al.'s rule for a one-hot proposal (accept d
    with chance p(d), else draw from p without d) – and a seed gives the very tokens plain
    decoding gives it."""
    k = len(draft)
    draws = sampler.draw_each(logprobs[: k + 1])
    n = 0
    while n < k and draws[n] == draft[n]:
        n += 1
    sampler.keep(n + 1)
    return n, draws[n]


def _normalised(logits: mx.array) -> mx.array:
    """Log-probabilities over the last axis."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def install(
    generator: Any,
    speculation: Speculation,
    stats: SpeculationStats,
    source: DraftSource | None = None,
) -> None:
    """Put a :class:`SpeculativeBatch` into a fresh ``BatchGenerator`` (drafting by prompt
    lookup unless given another ``source``: worker/speculative/drafts.py)."""
    batch = SpeculativeBatch.make(
        generator.model, generator.sampler, speculation, stats, source or PromptLookup()
    )
    batch.prompt_tokens = prompt_tokens_counter(generator)
    install_generation_batch(generator, batch)
