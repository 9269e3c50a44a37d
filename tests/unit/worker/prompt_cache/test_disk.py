"""The prompt cache's disk tier: what a node keeps across restarts, and the files it must skip
(corrupt, truncated, another format, another model) without a crash or a wrong token."""

from __future__ import annotations

import json
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from worker.chat.prompt import ChatTemplate
from worker.engine.core import Engine
from worker.engine.types import EngineConfig, Finished, GenerationRequest
from worker.prompt_cache.disk import DiskTier, DiskTierConfig, model_fingerprint, tokens_key
from worker.sampling import SamplingParams
from worker.testing import collect_logprobs, wait_until

GREEDY = SamplingParams(temperature=0.0)


def kv(tokens: int, seed: int = 0) -> list[KVCache]:
    """Two plain KV layers holding ``tokens`` positions of random keys and values."""
    mx.random.seed(seed)
    layers = []
    for _ in range(2):
        layer = KVCache()
        layer.update_and_fetch(
            mx.random.normal((1, 2, tokens, 8)), mx.random.normal((1, 2, tokens, 8))
        )
        layers.append(layer)
    return layers


def config(directory: Path, max_bytes: int = 1 << 30, fingerprint: str = "m") -> DiskTierConfig:
    return DiskTierConfig(str(directory), max_bytes, fingerprint, min_tokens=8, hot_interval_s=0)


def test_an_entry_survives_a_new_tier_and_loads_back_equal(tmp_path: Path) -> None:
    tier = DiskTier(config(tmp_path))
    tokens, cache = list(range(40)), kv(40)
    assert tier.save(tokens, cache)
    tier.flush()
    again = DiskTier(config(tmp_path))  # a restart: the index comes from the files
    entry, shared = again.best([*range(30), 99])
    assert entry is not None and shared == 30
    loaded = again.load(entry)
    assert loaded is not None
    for mine, theirs in zip(cache, loaded, strict=True):
        assert mx.array_equal(mine.keys[..., :40, :], theirs.keys[..., :40, :])
        assert theirs.offset == 40


def test_short_prefixes_and_sliding_windows_stay_in_memory(tmp_path: Path) -> None:
    from mlx_lm.models.cache import RotatingKVCache

    tier = DiskTier(config(tmp_path))
    assert not tier.save(list(range(4)), kv(4))  # below min_tokens
    window = RotatingKVCache(max_size=16)
    window.update_and_fetch(mx.zeros((1, 2, 20, 8)), mx.zeros((1, 2, 20, 8)))
    assert not tier.save(list(range(20)), [window])
    assert len(tier) == 0


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_file_is_skipped_with_one_line_and_removed(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier(config(tmp_path))
    tokens = list(range(40))
    tier.save(tokens, kv(40))
    tier.flush()
    data = tmp_path / f"{tokens_key(tokens)}.safetensors"
    raw = bytearray(data.read_bytes())
    if damage == "flip":
        raw[-10] ^= 0xFF
        data.write_bytes(bytes(raw))
    else:
        data.write_bytes(bytes(raw[: len(raw) // 2]))
    again = DiskTier(config(tmp_path))
    entry, _ = again.best(tokens)
    assert entry is not None
    assert again.load(entry) is None
    assert "checksum mismatch" in caplog.text
    assert len(again) == 0 and not data.exists()


def test_another_format_another_model_and_a_cut_write_are_skipped_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = DiskTier(config(tmp_path))
    first, second = list(range(40)), list(range(100, 140))
    tier.save(first, kv(40))
    tier.flush()
    tier.save(second, kv(40, seed=1))
    tier.flush()
    sidecar = tmp_path / f"{tokens_key(first)}.json"
    meta = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps(meta | {"format": 99}))
    (tmp_path / "cut.partial.safetensors").write_bytes(b"half a file")
    (tmp_path / "garbage.json").write_text("{not json")
    again = DiskTier(config(tmp_path))
    assert len(again) == 1 and second in again
    assert "format 99" in caplog.text and "unreadable description" in caplog.text
    assert not (tmp_path / "cut.partial.safetensors").exists()
    other_model = DiskTier(config(tmp_path, fingerprint="another"))
    assert len(other_model) == 0 and "another model's cache" in caplog.text


def test_the_bound_drops_the_least_recently_used_also_across_restarts(tmp_path: Path) -> None:
    tier = DiskTier(config(tmp_path))
    tier.save(list(range(40)), kv(40))
    tier.flush()
    one = tier.nbytes
    tier.save(list(range(100, 140)), kv(40, seed=1))
    tier.flush()
    first, _ = tier.best(list(range(41)))
    time.sleep(0.05)  # past the file system's clock granularity
    assert first is not None and tier.load(first) is not None  # used: now the most recent
    again = DiskTier(config(tmp_path, max_bytes=2 * one + one // 2))
    again.save(list(range(200, 240)), kv(40, seed=2))
    again.flush()
    assert list(range(40)) in again and list(range(200, 240)) in again
    assert list(range(100, 140)) not in again


def test_the_model_fingerprint_follows_the_config_and_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    before = model_fingerprint(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"x" * 11)
    assert model_fingerprint(str(tmp_path)) != before


# ---- the engine across a restart -------------------------------------------------------------


def start(model_dir: Path, disk: DiskTierConfig | None) -> Engine:
    engine = Engine(str(model_dir), config=EngineConfig(prompt_cache_disk=disk))
    engine.start(timeout=60)
    return engine


async def answer(engine: Engine, prompt: list[int]) -> tuple[list[tuple[str, float]], Finished]:
    job = engine.submit(GenerationRequest(prompt, 8, GREEDY, logprobs=True))
    return await collect_logprobs(engine, job)


def conversation(engine: Engine) -> tuple[list[int], list[int]]:
    """An agent's first turn and its second (the first plus more)."""
    text = " ".join(f"Step {i}: read the file and check the tests." for i in range(12))
    template = ChatTemplate(engine.tokenizer)
    first, _ = template.render([{"role": "user", "content": text}], None, {})
    second, _ = template.render(
        [
            {"role": "user", "content": text},
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": "Now run them."},
        ],
        None,
        {},
    )
    return first, second


async def test_a_restarted_engine_answers_from_the_disk_tier_token_for_token(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    disk = DiskTierConfig(str(tmp_path), 1 << 30, model_fingerprint(str(tiny_model_dir)), 16, 0)
    engine = start(tiny_model_dir, disk)
    first, second = conversation(engine)
    await answer(engine, first)
    await wait_until(lambda: engine.stats.commits == 1)
    engine.close()  # shutdown writes what memory holds
    assert len(DiskTier(disk)) == 1

    restarted = start(tiny_model_dir, disk)
    cold = start(tiny_model_dir, None)
    try:
        warm_tokens, warm = await answer(restarted, second)
        cold_tokens, _ = await answer(cold, second)
        assert warm.cached_tokens >= len(first) - 1
        # The same tokens; their logprobs agree to float32 noise (the cold prefill adds up the
        # prompt in other chunks than the one whose KV was stored).
        assert [text for text, _ in warm_tokens] == [text for text, _ in cold_tokens]
        assert [p for _, p in warm_tokens] == pytest.approx([p for _, p in cold_tokens], abs=1e-4)
        assert restarted.prompt_cache_disk is not None
        assert restarted.prompt_cache_disk["loads"] == 1
    finally:
        restarted.close()
        cold.close()


async def test_the_warm_up_leaves_nothing_on_disk(tiny_model_dir: Path, tmp_path: Path) -> None:
    disk = DiskTierConfig(str(tmp_path), 1 << 30, model_fingerprint(str(tiny_model_dir)), 16, 0)
    engine = start(tiny_model_dir, disk)
    try:
        first, _ = conversation(engine)
        await answer(engine, first)
        await wait_until(lambda: engine.stats.commits == 1)
        await wait_until(lambda: any(tmp_path.glob("*.json")))  # a hot write (interval 0)
        engine.discard_prompt_cache()
        await wait_until(lambda: not any(tmp_path.glob("*.json")))
    finally:
        engine.close()


def test_the_routing_question_sees_each_tier_and_a_restore_is_timed(tmp_path: Path) -> None:
    from worker.prompt_cache.digest import block_hashes
    from worker.prompt_cache.store import PromptCacheStore

    tier = DiskTier(config(tmp_path), block_size=8)
    tier.save(list(range(200)), kv(200))
    tier.flush()
    store = PromptCacheStore(digest_block_size=8, disk=DiskTier(config(tmp_path), block_size=8))
    store.insert(list(range(16)), kv(16))  # memory holds the first 16 (the disk tier too, now)
    asked = block_hashes([*range(200), 7, 7, 7, 7, 7, 7, 7, 7], 8)
    assert store.held(asked) == (2, 25)  # blocks: 16 tokens in memory, 200 on disk
    assert store.disk is not None and store.disk.restore_tokens_per_second() is None
    cache, cached = store.fetch([*range(200), 7])  # a disk hit: read back, then served
    assert cached == 200 and cache is not None
    assert store.disk.restore_tokens_per_second() > 0
    assert store.held(asked)[0] == 25  # now in memory too
