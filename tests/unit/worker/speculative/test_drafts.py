"""A draft model proposes the tokens the batch verifies (worker/speculative/drafts.py): at temperature 0
the answers are token for token the ones decoding without speculation gives, a draft with the
model's own weights is accepted, and a draft of another vocabulary is refused."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from worker.chat.prompt import ChatTemplate
from worker.engine.core import Engine, EngineError
from worker.engine.types import EngineConfig, Finished, GenerationRequest, TokenChunk
from worker.sampling import SamplingParams
from worker.speculative.drafts import check_draft_dirs
from worker.speculative.policy import Speculation
from worker.testing import make_tiny_model

GREEDY = SamplingParams(temperature=0.0)
TEXTS = ["Hello world! How are you today?", "The quick brown fox", "0123456789"]


def start(
    model_dir: Path, speculation: str = "auto", draft_tokens: int = 8, **config: Any
) -> Engine:
    # A fixed, low cost of a drafted position: on the tiny model a step is so cheap that the
    # measured one would (rightly) decline most drafts, and these tests are about drafting.
    rule = Speculation(mode=speculation, draft_tokens=draft_tokens, slope=0.05)
    engine = Engine(
        str(model_dir), config=EngineConfig(loop_guard_tokens=0, speculation=rule, **config)
    )
    engine.start(timeout=60)
    return engine


@pytest.fixture(scope="module")
def small_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another random model with the tiny models' tokenizer: one layer, other weights."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-draft") / "model", seed=7, num_layers=1)


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> Iterator[Engine]:
    engine = start(tiny_model_dir, speculation="off")
    yield engine
    engine.close()


async def answers(engine: Engine, sampling: SamplingParams = GREEDY) -> list[Any]:
    """The batch of TEXTS at once: (text, finish, logprob tokens, logprob values) each."""

    async def one(i: int, text: str) -> Any:
        prompt, _ = ChatTemplate(engine.tokenizer).render(
            [{"role": "user", "content": text}], None, {}
        )
        job = engine.submit(GenerationRequest(prompt, 30 + 13 * i, sampling, logprobs=True))
        pieces, logprobs = [], []
        async for event in job.events():
            if isinstance(event, TokenChunk):
                pieces.append(event.text)
                logprobs.extend(event.logprobs or [])
            else:
                assert isinstance(event, Finished), event
                tokens = [e.token for e in logprobs]
                values = [e.logprob for e in logprobs]
                return "".join(pieces), event.completion_tokens, tokens, values
        raise AssertionError("no terminal event")

    return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(TEXTS))))


def assert_same(plain: list[Any], drafted: list[Any]) -> None:
    for (text, n, tokens, values), (text2, n2, tokens2, values2) in zip(
        plain, drafted, strict=True
    ):
        assert (text2, n2, tokens2) == (text, n, tokens)
        assert np.allclose(values2, values, atol=1e-3)


async def test_a_draft_with_the_models_own_weights_is_accepted_and_changes_nothing(
    plain: Engine, tiny_model_dir: Path
) -> None:
    engine = start(tiny_model_dir, draft_model=str(tiny_model_dir))
    try:
        assert_same(await answers(plain), await answers(engine))
        stats = engine.speculation.as_dict()
        assert engine.draft_source == str(tiny_model_dir)
    finally:
        engine.close()
    assert stats["accepted"] > 0
    assert stats["acceptance_rate"] > 0.5  # the same model guesses its own argmax
    assert stats["tokens_per_step"] > 2


async def test_a_different_small_draft_model_changes_no_token(
    plain: Engine, tiny_model_dir: Path, small_draft_dir: Path
) -> None:
    """Its guesses are mostly wrong (other random weights): the rows trim what it proposed and
    its own caches roll back to the accepted tokens; the answers stay decoding's."""
    engine = start(tiny_model_dir, draft_model=str(small_draft_dir), draft_tokens=4)
    try:
        assert_same(await answers(plain), await answers(engine))
        assert engine.speculation.drafted > 0
    finally:
        engine.close()


async def test_sampling_with_a_draft_model_runs_to_its_length(
    tiny_model_dir: Path,
) -> None:
    engine = start(tiny_model_dir, draft_model=str(tiny_model_dir))
    try:
        results = await answers(engine, SamplingParams(temperature=0.3, seed=3))
        assert [n for _, n, _, _ in results] == [30 + 13 * i for i in range(len(TEXTS))]
        assert engine.speculation.accepted > 0
    finally:
        engine.close()


def test_a_draft_model_of_another_vocabulary_is_refused(
    tiny_model_dir: Path, tiny_tool_model_dir: Path
) -> None:
    """The tool model's tokenizer has its script's pieces added."""
    reason = check_draft_dirs(tiny_model_dir, tiny_tool_model_dir)
    assert reason is not None and "vocabulary" in reason
    engine = Engine(str(tiny_model_dir), config=EngineConfig(draft_model=str(tiny_tool_model_dir)))
    with pytest.raises(EngineError, match=r"draft model .* refused: .*vocabulary"):
        engine.start(timeout=60)
    engine.close()


def test_the_same_vocabulary_passes_the_check(tiny_model_dir: Path, small_draft_dir: Path) -> None:
    assert check_draft_dirs(tiny_model_dir, small_draft_dir) is None
    assert check_draft_dirs(tiny_model_dir, "some/hub-id") is None  # checked at load instead


def test_a_rows_draft_caches_roll_back_to_the_accepted_tokens(small_draft_dir: Path) -> None:
    """After a draft is rejected, the row's next draft is the one a fresh row would make from
    the same tokens (its KV of the rejected guesses is gone)."""
    from mlx_lm import load

    from worker.speculative.drafts import DraftModel

    model, tokenizer = load(str(small_draft_dir))[:2]
    source = DraftModel(model, len(tokenizer.get_vocab()))
    context = tokenizer.encode("The quick brown fox jumps over the lazy dog")
    row = source.row()
    first = row.draft(context, 5, 6)
    assert len(first) == 6
    # The model kept two guesses, then chose another token than the third.
    accepted = [*context, 5, *first[:2]]
    other = (first[2] + 1) % 300
    again = row.draft(accepted, other, 6)
    assert again == source.row().draft(accepted, other, 6)
    assert row.fed == [*accepted, other, *again[:-1]]  # type: ignore[attr-defined]
    assert [c.offset for c in row.cache] == [len(row.fed)] * len(row.cache)  # type: ignore[attr-defined]
