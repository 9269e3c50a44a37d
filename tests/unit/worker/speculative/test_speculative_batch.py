"""Speculative decoding in the batching engine (worker/speculative/batch.py) on the tiny models: at
temperature 0 every answer is token for token the one decoding without speculation gives (text,
finish, logprobs, stop strings, loop guard, grammar rows, tool prompts, the KV it leaves for the
prompt cache); above it the rejection rule keeps the model's distribution (chi-square)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from worker.chat.prompt import ChatTemplate
from worker.engine.core import Engine, Job
from worker.engine.types import (
    EngineConfig,
    Finished,
    GenerationRequest,
    TokenChunk,
    TokenLogprob,
)
from worker.sampling import RequestSampler, SamplingParams
from worker.speculative.batch import _accept_sampled
from worker.speculative.policy import (
    RowPolicy,
    Speculation,
)
from worker.structured.json_grammar import json_grammar
from worker.structured.processor import make_grammar_processor
from worker.testing import wait_until

GREEDY = SamplingParams(temperature=0.0)
Outcome = tuple[str, Finished, list[TokenLogprob], Job]


def start(model_dir: Path, speculation: str, max_rows: int = 4, **config: Any) -> Engine:
    config.setdefault("loop_guard_tokens", 0)
    # A fixed, low cost of a drafted position: on the tiny model a step is so cheap that the
    # measured one would (rightly) decline most drafts, and these tests are about drafting.
    rule = Speculation(mode=speculation, max_rows=max_rows, slope=0.05)
    engine = Engine(str(model_dir), config=EngineConfig(speculation=rule, **config))
    engine.start(timeout=60)
    return engine


@contextmanager
def engines_of(model_dir: Path, **config: Any) -> Iterator[tuple[Engine, Engine]]:
    """The same model without and with speculation, closed at the end."""
    engines = start(model_dir, "off", **config), start(model_dir, "auto", **config)
    try:
        yield engines
    finally:
        for engine in engines:
            engine.close()


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    with engines_of(tiny_model_dir) as engines:
        yield engines


def prompt_of(engine: Engine, text: str, tools: list[dict[str, Any]] | None = None) -> list[int]:
    tokens, _ = ChatTemplate(engine.tokenizer).render(
        [{"role": "user", "content": text}], tools, {}
    )
    return tokens


async def run(engine: Engine, request: GenerationRequest, commit: bool = True) -> Outcome:
    job = engine.submit(request)
    text, logprobs = [], []
    async for event in job.events():
        if isinstance(event, TokenChunk):
            text.append(event.text)
            logprobs.extend(event.logprobs or [])
        else:
            assert isinstance(event, Finished), event
            if commit:
                engine.commit(job)
            return "".join(text), event, logprobs, job
    raise AssertionError("no terminal event")


async def both(
    pair: tuple[Engine, Engine],
    requests: Callable[[Engine], list[GenerationRequest]],
    commit: bool = True,
) -> tuple[list[Outcome], list[Outcome]]:
    """Each engine runs its own copy of the requests, all at once (one batch)."""
    results = []
    for engine in pair:
        batch = requests(engine)
        results.append(await asyncio.gather(*(run(engine, r, commit) for r in batch)))
    return results[0], results[1]


def assert_same(plain: list[Outcome], speculated: list[Outcome]) -> None:
    for (text, done, logprobs, _), (text2, done2, logprobs2, _) in zip(
        plain, speculated, strict=True
    ):
        assert text2 == text
        # cached_tokens says which rows shared a prefill, which depends on when each request
        # reached the scheduler (shared prefill), not on speculation: compared apart from it.
        assert replace(done2, cached_tokens=0) == replace(done, cached_tokens=0)
        assert [e.token for e in logprobs2] == [e.token for e in logprobs]
        assert np.allclose([e.logprob for e in logprobs2], [e.logprob for e in logprobs], atol=1e-3)
        # The most likely tokens at each position too: the same tokens, the same numbers.
        assert [[t for t, _ in e.top] for e in logprobs2] == [
            [t for t, _ in e.top] for e in logprobs
        ]
        for e, e2 in zip(logprobs, logprobs2, strict=True):
            assert np.allclose([p for _, p in e2.top], [p for _, p in e.top], atol=1e-3)


async def test_greedy_batch_gives_the_same_tokens_and_logprobs(
    pair: tuple[Engine, Engine],
) -> None:
    """Rows of one batch accept different numbers of drafts and trim their KV independently;
    every answer equals decoding's."""
    texts = ["Hello world! How are you today?", "The quick brown fox", "0123456789", "Paris"]

    def requests(engine: Engine) -> list[GenerationRequest]:
        return [
            GenerationRequest(prompt_of(engine, t), max_tokens=40 + 17 * i, sampling=GREEDY,
                              logprobs=i % 2 == 0, top_logprobs=5 if i == 0 else 0)
            for i, t in enumerate(texts)
        ]  # fmt: skip

    before = pair[1].speculation.as_dict()
    plain, speculated = await both(pair, requests)
    assert_same(plain, speculated)
    # Greedy: each token is the likeliest at its position, the first of its top five.
    assert all(len(e.top) == 5 and e.top[0][0] == e.token for e in plain[0][2])
    after = pair[1].speculation.as_dict()
    assert after["accepted"] > before["accepted"]  # it did speculate
    assert after["tokens_per_step"] > 1
    assert pair[0].speculation.verify_steps == 0


async def test_a_tool_prompt_and_a_tool_call_are_the_same(
    pair: tuple[Engine, Engine], tiny_tool_model_dir: Path
) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip

    def requests(engine: Engine) -> list[GenerationRequest]:
        prompt = prompt_of(engine, "What is the weather in Paris?", tools)
        return [GenerationRequest(prompt, 60, GREEDY), GenerationRequest(prompt[:-2], 30, GREEDY)]

    assert_same(*await both(pair, requests))
    with engines_of(tiny_tool_model_dir) as tool_pair:
        plain, speculated = await both(tool_pair, requests)
        assert "get_weather" in plain[0][0]
        assert_same(plain, speculated)


async def test_rows_under_a_grammar_or_penalties_draft_and_answer_as_decoding_does(
    pair: tuple[Engine, Engine],
) -> None:
    """A grammar's matcher consumes each drafted token as its position is processed and gives
    back the refused ones; penalties and logit bias see each position's own context. Their
    rows draft (beside plain ones, in the same verify passes) and answer token for token as
    decoding does."""
    grammar = json_grammar({"type": "object", "properties": {"a": {"type": "string"}}})
    text = 'json {"a": "hello hello"}'
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    biased = SamplingParams(temperature=0.0, logit_bias={5: 3.0}, presence_penalty=0.5)

    def grammar_only(engine: Engine) -> list[GenerationRequest]:
        processor = make_grammar_processor(engine.tokenizer, grammar)
        return [GenerationRequest(prompt_of(engine, text), 60, GREEDY, logits_processors=(processor,))]  # fmt: skip

    def mixed(engine: Engine) -> list[GenerationRequest]:
        return [
            *grammar_only(engine),
            GenerationRequest(prompt_of(engine, text), 60, penalised, logits_processors=(
                make_grammar_processor(engine.tokenizer, grammar),), logprobs=True, top_logprobs=3),
            GenerationRequest(prompt_of(engine, text), 50, biased, logprobs=True, top_logprobs=3),
            GenerationRequest(prompt_of(engine, "The quick brown fox"), 60, GREEDY),
        ]  # fmt: skip

    before = pair[1].speculation.as_dict()
    assert_same(*await both(pair, grammar_only))
    alone = pair[1].speculation.as_dict()
    assert alone["accepted"] > before["accepted"], "the grammar row never drafted"
    assert_same(*await both(pair, mixed))
    after = pair[1].speculation.as_dict()
    assert after["drafted"] - alone["drafted"] > after["accepted"] - alone["accepted"] > 0


async def test_a_row_with_a_processor_that_cannot_see_drafts_decodes_beside_drafting_rows(
    pair: tuple[Engine, Engine],
) -> None:
    """A processor with none of the draft hooks (a bare function) keeps its row to a token a
    step, in the same verify passes as rows that draft, and nothing asks it to give back."""

    def unchanged(tokens: mx.array, logits: mx.array) -> mx.array:
        return logits

    def requests(engine: Engine) -> list[GenerationRequest]:
        return [
            GenerationRequest(prompt_of(engine, "json"), 40, GREEDY, logits_processors=(unchanged,)),
            GenerationRequest(prompt_of(engine, "The quick brown fox"), 60, GREEDY),
        ]  # fmt: skip

    before = pair[1].speculation.accepted
    assert_same(*await both(pair, requests))
    assert pair[1].speculation.accepted > before


class _Oracle:
    """Drafts the answer plain decoding gave, with every other draft wrong from its second
    token on: drafts accepted whole, refused part way (the matcher gives tokens back) and cut
    by the grammar all happen."""

    def __init__(self, prompt: list[int], answer: list[int]) -> None:
        self.prompt, self.answer, self.calls = prompt, answer, 0

    def ready(self, tokens: Any) -> bool:
        return len(tokens) - len(self.prompt) + 1 < len(self.answer)

    def draft(self, tokens: Any, sampled: int, limit: int) -> list[int]:
        at = len(tokens) - len(self.prompt) + 1  # answer tokens so far, the sampled one too
        draft = list(self.answer[at : at + limit])
        self.calls += 1
        if self.calls % 2 and len(draft) > 1:
            draft[1] = 3 + (draft[1] + 1) % 90
        return draft

    def guess(self, tokens: Any) -> int | None:
        return None


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_grammar_row_gives_back_refused_drafts_greedy_and_seeded(
    tiny_model_dir: Path, temperature: float
) -> None:
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    from worker.sampling import make_request_sampler
    from worker.speculative.batch import SpeculationStats, install

    model, tokenizer = load(str(tiny_model_dir))
    grammar = json_grammar({"type": "object", "properties": {"a": {"type": "string"}}})
    params = SamplingParams(temperature=temperature, seed=11)
    prompt = tokenizer.encode('json {"a": "hello"}')

    def answer(source: Any = None) -> tuple[list[int], SpeculationStats]:
        generator = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=2)
        stats = SpeculationStats()
        if source is not None:
            install(generator, Speculation(slope=0.05), stats, source)
        (uid,) = generator.insert(
            [prompt], max_tokens=[40], samplers=[make_request_sampler(params)],
            logits_processors=[[make_grammar_processor(tokenizer, grammar)]],
        )  # fmt: skip
        tokens: list[int] = []
        while len(tokens) < 40:
            tokens += [r.token for r in generator.next()[1] if r.uid == uid]
        generator.close()
        return tokens, stats

    plain, _ = answer()
    oracle = _Oracle(prompt, plain)

    class Source:
        def row(self) -> _Oracle:
            return oracle

    speculated, stats = answer(Source())
    assert speculated == plain
    assert stats.accepted > 0 and stats.drafted > stats.accepted  # both ways, really


async def test_a_stop_string_inside_an_accepted_draft_ends_there_and_keeps_that_kv_only(
    pair: tuple[Engine, Engine],
) -> None:
    """The answer ends at the stop string as decoding's does, and the KV held for the prompt
    cache covers the prompt and the tokens given to the client only, not the rest of the draft
    the verify pass accepted."""
    off = pair[0]
    prompt = prompt_of(off, "Hello world! How are you today?")
    text, *_ = await run(off, GenerationRequest(prompt, 80, GREEDY))
    stop = text[:25]  # first complete 25 characters in: after speculation got going
    assert len(stop) == 25

    def requests(engine: Engine) -> list[GenerationRequest]:
        return [GenerationRequest(prompt, 80, GREEDY, stop=(stop,), logprobs=True)]

    plain, speculated = await both(pair, requests, commit=False)
    assert_same(plain, speculated)
    assert speculated[0][1].stop_sequence == stop
    held = []
    for engine, outcome in zip(pair, (plain[0], speculated[0]), strict=True):
        pending = engine._commits.pending[outcome[3].id]
        held.append(pending.tokens)
        assert pending.cache[0].offset == len(pending.tokens)
        engine.commit(outcome[3])
    assert held[1] == held[0]
    assert len(held[1]) == len(prompt) + speculated[0][1].completion_tokens


async def test_the_loop_guard_ends_the_same_answer_at_the_same_token(tiny_model_dir: Path) -> None:
    with engines_of(tiny_model_dir, loop_guard_tokens=24) as guarded:

        def requests(engine: Engine) -> list[GenerationRequest]:
            return [GenerationRequest(prompt_of(engine, t), 300, GREEDY) for t in ("Hi", "Paris")]

        plain, speculated = await both(guarded, requests, commit=False)
        assert_same(plain, speculated)
        assert guarded[1].stats.loops_stopped == guarded[0].stats.loops_stopped > 0
        for engine, outcome in zip(guarded, (plain[0], speculated[0]), strict=True):
            pending = engine._commits.pending[outcome[3].id]
            assert (
                len(pending.tokens) == len(outcome[3].request.prompt) + outcome[1].completion_tokens
            )
            assert pending.cache[0].offset == len(pending.tokens)


async def test_a_cancelled_job_keeps_the_kv_of_the_tokens_it_was_given(
    pair: tuple[Engine, Engine],
) -> None:
    off, on = pair
    prompt = prompt_of(on, "a conversation the client leaves")
    job = on.submit(GenerationRequest(prompt, 3000, GREEDY))
    async for event in job.events():
        if isinstance(event, TokenChunk) and event.completion_tokens >= 12:
            on.cancel(job)
            break
    await wait_until(lambda: "cache_kept" in on.stats.events_for(job.id))
    entries = [e for e in on._store._entries.values() if e.tokens[: len(prompt)] == tuple(prompt)]
    assert entries
    kept = entries[-1]
    assert kept.cache[0].offset == len(kept.tokens)
    # What it kept is the answer decoding gives, as far as it went.
    answer = list(kept.tokens[len(prompt) :])
    assert len(answer) >= 12
    plain, *_ = await run(off, GenerationRequest(prompt, len(answer), GREEDY))
    assert on.tokenizer.decode(answer) == plain


async def test_a_batch_wider_than_max_rows_decodes_without_drafting(tiny_model_dir: Path) -> None:
    engine = start(tiny_model_dir, "auto", max_rows=1)
    try:
        prompts = [prompt_of(engine, t) for t in ("Hello", "Paris", "fox")]
        requests = [GenerationRequest(p, 80, GREEDY) for p in prompts]
        await asyncio.gather(*(run(engine, r) for r in requests))
        # Only once the batch has thinned out to one row (shorter answers could end first, here
        # they all end together) may it draft.
        assert engine.speculation.verify_steps == 0
    finally:
        engine.close()


async def test_a_sliding_window_model_speculates_and_gives_the_same_tokens(
    sliding_model_dir: Path,
) -> None:
    """A sliding-window layer (gemma 2/3, gpt-oss) hands its rejected tail back too: rows of
    one batch, prompts and answers longer than the window (8) so it rotates between verify
    passes, then a second turn that resumes from the committed cache."""
    texts = ["Hello world! How are you today?", "The quick brown fox", "0123456789", "Paris"]
    with engines_of(sliding_model_dir) as sliding:

        def requests(engine: Engine) -> list[GenerationRequest]:
            return [
                GenerationRequest(prompt_of(engine, t), max_tokens=30 + 11 * i, sampling=GREEDY,
                                  logprobs=True)
                for i, t in enumerate(texts)
            ]  # fmt: skip

        first = await both(sliding, requests)
        assert_same(*first)
        assert sliding[1].speculation.accepted > 0

        def second_turn(engine: Engine) -> list[GenerationRequest]:
            answer = first[0][0][0]
            turn = [
                {"role": "user", "content": texts[0]},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "And again?"},
            ]
            tokens, _ = ChatTemplate(engine.tokenizer).render(turn, None, {})
            return [GenerationRequest(tokens, 40, GREEDY, logprobs=True)]

        plain, speculated = await both(sliding, second_turn)
        assert_same(plain, speculated)
        assert speculated[0][1].cached_tokens > 0  # it resumed from the cache


async def test_a_seed_gives_the_same_tokens_with_speculation_as_without(
    pair: tuple[Engine, Engine],
) -> None:
    """Each position's token is drawn with the key plain decoding draws it with, whether a
    verify pass or a plain step reaches it: rows of a batch, drafts accepted and refused."""
    texts = ["Hello world! How are you today?", "The quick brown fox", "0123456789"]

    def requests(engine: Engine) -> list[GenerationRequest]:
        return [
            GenerationRequest(prompt_of(engine, t), max_tokens=120, logprobs=True,
                              sampling=SamplingParams(temperature=0.05, top_p=0.95, seed=40 + i))
            for i, t in enumerate(texts)
        ]  # fmt: skip

    before = pair[1].speculation.as_dict()
    plain, speculated = await both(pair, requests)
    assert_same(plain, speculated)
    after = pair[1].speculation.as_dict()
    assert after["accepted"] > before["accepted"]
    assert after["drafted"] - before["drafted"] > after["accepted"] - before["accepted"]  # refusals


async def test_seeded_sampling_with_speculation_is_reproducible(
    pair: tuple[Engine, Engine],
) -> None:
    on = pair[1]
    params = SamplingParams(temperature=0.7, seed=11)
    prompt = prompt_of(on, "The quick brown fox")
    first, done, *_ = await run(on, GenerationRequest(prompt, 60, params))
    again, done2, *_ = await run(on, GenerationRequest(prompt, 60, params))
    assert (again, done2.completion_tokens) == (first, done.completion_tokens)


# ---- the rejection rule keeps the distribution ----------------------------------------------


def _chi_square_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """The p-value of Pearson's chi-square (Wilson-Hilferty's normal approximation)."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    k = len(observed) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _tiny_logprobs(model_dir: Path) -> mx.array:
    """A real next-token distribution: the tiny model's logprobs after a short prompt, three
    positions (a two-token draft and the one after it)."""
    from mlx_lm import load

    model, _ = load(str(model_dir))
    logits = model(mx.array([[5, 9, 14, 3, 7]]))[0, -3:, :].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.3, seed=3),
    SamplingParams(temperature=0.4, top_k=12, top_p=0.95, seed=4),
])  # fmt: skip
def test_accepted_or_rejected_the_first_token_follows_the_models_distribution(
    tiny_model_dir: Path, params: SamplingParams
) -> None:
    """Thousands of verify steps of a two-token draft (the likeliest first token, not a sure
    one; the second likeliest second): the emitted first token's frequencies fit p
    (chi-square), and so do the second token's given that the first draft was accepted, with
    both the accepting and the rejecting (residual) paths taken often."""
    logprobs = _tiny_logprobs(tiny_model_dir)
    sampler = RequestSampler(params)
    probs = np.array(sampler.probs(logprobs).tolist())
    draft = [int(np.argmax(probs[0])), int(np.argsort(probs[1])[-2])]
    assert 0.2 < probs[0].max() < 0.9
    draws = 4000
    firsts = np.zeros(probs.shape[1])
    seconds = np.zeros(probs.shape[1])
    for _ in range(draws):
        n, token = _accept_sampled(sampler, logprobs, draft)
        firsts[draft[0] if n >= 1 else token] += 1
        if n >= 1:
            seconds[draft[1] if n >= 2 else token] += 1
    for observed, p in ((firsts, probs[0]), (seconds, probs[1])):
        keep = p * observed.sum() >= 5  # Pearson's rule of thumb; the rest pooled
        obs = np.append(observed[keep], observed[~keep].sum())
        exp = np.append(p[keep], p[~keep].sum()) * observed.sum()
        if exp[-1] < 5:
            obs, exp = obs[:-1], exp[:-1]
            exp = exp * obs.sum() / exp.sum()
        assert len(obs) >= 3
        assert _chi_square_p(obs, exp) > 0.001
    assert draws * 0.1 < seconds.sum() < draws * 0.9  # the first draft accepted, and not


def test_the_chi_square_check_can_fail() -> None:
    """The check above rejects a skewed sample (so its passing means something)."""
    expected = np.array([0.5, 0.3, 0.2]) * 4000
    assert _chi_square_p(np.array([2150.0, 1100.0, 750.0]), expected) < 0.001
    assert _chi_square_p(np.array([2010.0, 1190.0, 800.0]), expected) > 0.05


# ---- a row's rests and free guesses, on the batch --------------------------------------------


class _FailsThenCopies:
    """Drafts wrong tokens until the row first pauses (its policy put it to rest), the answer
    plain decoding gave from then on; guesses the answer's next token for free, or never."""

    def __init__(self, prompt: list[int], answer: list[int], guesses: bool) -> None:
        self.prompt, self.answer, self.guesses = prompt, answer, guesses
        self.drafted_at: list[int] = []  # answer tokens so far at each draft

    def _at(self, tokens: Any) -> int:
        return len(tokens) - len(self.prompt)

    def pause(self) -> int | None:
        """Steps between the drafts around the row's first rest."""
        gaps = [b - a for a, b in zip(self.drafted_at, self.drafted_at[1:], strict=False)]
        return next((gap for gap in gaps if gap > 1), None)

    def ready(self, tokens: Any) -> bool:
        return self._at(tokens) + 1 < len(self.answer)

    def draft(self, tokens: Any, sampled: int, limit: int) -> list[int]:
        at = self._at(tokens) + 1  # the sampled token is the answer's too
        self.drafted_at.append(at)
        right = list(self.answer[at : at + limit])
        return right if self.pause() else [3 + (t + 1) % 90 for t in right]

    def guess(self, tokens: Any) -> int | None:
        at = self._at(tokens)
        return self.answer[at] if self.guesses and at < len(self.answer) else None


@pytest.mark.parametrize(
    ("guesses", "wake_hits"),
    [(True, 2), (False, 2), (True, 0)],
    ids=["free guesses", "no guesses", "guesses turned off"],
)
def test_a_resting_row_whose_guesses_stand_drafts_again_before_its_rest_is_over(
    tiny_model_dir: Path, guesses: bool, wake_hits: int
) -> None:
    """Drafts that fail put the row to rest (8 steps or more); while it rests, its guesses of
    each next token stand (the text copies again): it drafts again after two of them, not after
    the whole rest. Without free guesses it sits the rest out. The answer is plain decoding's."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    from worker.sampling import greedy
    from worker.speculative.batch import SpeculationStats, install

    model, _ = load(str(tiny_model_dir))
    prompt = list(range(3, 12))

    def run(source: Any) -> list[int]:
        generator = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=2)
        if source is not None:
            rule = Speculation(slope=0.05, wake_hits=wake_hits)
            install(generator, rule, SpeculationStats(), source)
        (uid,) = generator.insert([prompt], max_tokens=[80], samplers=[greedy])
        answer: list[int] = []
        while len(answer) < 80:
            answer += [r.token for r in generator.next()[1] if r.uid == uid]
        generator.close()
        return answer

    plain = run(None)
    row = _FailsThenCopies(prompt, plain, guesses)

    class Source:
        def row(self) -> _FailsThenCopies:
            return row

    assert run(Source()) == plain
    pause = row.pause()
    assert pause is not None, f"the row never rested and drafted again: {row.drafted_at}"
    assert pause <= 4 if guesses and wake_hits else pause > 8, row.drafted_at


class _MatchesButNeverDrafts:
    """A row whose context always seems to match and whose draft always comes out empty."""

    def __init__(self) -> None:
        self.asked = 0

    def ready(self, tokens: Any) -> bool:
        self.asked += 1
        return True

    def draft(self, tokens: Any, sampled: int, limit: int) -> list[int]:
        return []

    def guess(self, tokens: Any) -> int | None:
        return None


def test_a_row_whose_drafts_come_out_empty_rests_like_one_whose_drafts_fail(
    tiny_model_dir: Path,
) -> None:
    """Each empty draft cost the step a sync on its sampled token: the row's policy counts it
    as refused tokens, so after a window of them it stops asking (and the step pipelines)."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    from worker.sampling import greedy
    from worker.speculative.batch import SpeculationStats, install

    model, _ = load(str(tiny_model_dir))
    generator = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=2)
    stats, row = SpeculationStats(), _MatchesButNeverDrafts()

    class Source:
        def row(self) -> _MatchesButNeverDrafts:
            return row

    install(generator, Speculation(), stats, Source())
    (uid,) = generator.insert([list(range(3, 12))], max_tokens=[60], samplers=[greedy])
    tokens = 0
    while tokens < 60:
        tokens += sum(1 for r in generator.next()[1] if r.uid == uid)
    policy = RowPolicy()
    asked_before_rest = policy.window // 2  # two refused tokens an empty draft
    # 12 asks, a 16-step rest, 12 asks, then a 32-step rest that outlasts the 60 tokens.
    assert policy.rest_steps == 16 and asked_before_rest == 12
    assert stats.empty_drafts == row.asked == 2 * asked_before_rest
    assert stats.verify_steps == 0
    generator.close()


class _AlwaysDrafts:
    """A row whose context always matches and whose draft is always its sampled token again."""

    def ready(self, tokens: Any) -> bool:
        return True

    def draft(self, tokens: Any, sampled: int, limit: int) -> list[int]:
        return [sampled] * min(limit, 2)

    def guess(self, tokens: Any) -> int | None:
        return None


def test_a_joining_rows_first_token_is_not_held_behind_a_verify_pass(
    tiny_model_dir: Path,
) -> None:
    """The step after a row's prefill hands its first token out by itself: a verify pass for
    the running rows would hold that token (the time to first token) for a whole pass."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    from worker.sampling import greedy
    from worker.speculative.batch import SpeculationStats, install

    model, _ = load(str(tiny_model_dir))
    generator = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=2)
    stats = SpeculationStats()

    class Source:
        def row(self) -> _AlwaysDrafts:
            return _AlwaysDrafts()

    install(generator, Speculation(slope=0.05), stats, Source())
    generator.insert([list(range(3, 12))], max_tokens=[200], samplers=[greedy])
    for _ in range(50):
        generator.next()
        if stats.verify_steps:
            break
    assert stats.verify_steps, "the running row never verified a draft: the test proves nothing"
    (joining,) = generator.insert([list(range(20, 30))], max_tokens=[20], samplers=[greedy])
    for _ in range(50):
        before = stats.verify_steps
        responses = generator.next()[1]
        if any(r.uid == joining for r in responses):
            break
    else:
        raise AssertionError("the joining row never gave a token")
    assert stats.verify_steps == before
    for _ in range(5):
        generator.next()
    assert stats.verify_steps > before, "drafting never resumed after the first token"
    generator.close()
