"""Rank 0 of a split group keeps the prompt cache and shared prefills of an unsplit worker
(worker/split/cache.py): over 2 and 3 real rank processes (MLX ring backend on loopback), a
conversation's second turn reuses the first turn's KV (``cached_tokens`` in its usage), several
requests at once share one prefill, and every answer at temperature 0 is the unsplit worker's
with the same settings, request for request."""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from mesh.split import testing as split_testing
from worker.cpu.fast_path import REEXEC_MARKER
from worker.serve.split_rank import GROUP_BROKEN, leader_config
from worker.testing import make_tiny_model, run_worker_in_thread

mx = pytest.importorskip("mlx.core")
if not mx.distributed.is_available("ring"):
    pytest.skip("this MLX build has no ring backend (mx.distributed)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "You are a helpful assistant. Answer in one short sentence, and be precise about it."
QUESTIONS = ["Name a river.", "Name a mountain.", "Name a city."]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # No sliding window: every layer's cache can be trimmed back to a shared prefix.
    return make_tiny_model(tmp_path_factory.mktemp("split-cache") / "m", num_layers=6)


def script(base: str, name: str) -> dict[str, Any]:
    """What a client does: two turns of one conversation, then three requests at once that
    share a long system prompt. Every answer and its usage."""

    def chat(client: httpx.Client, messages: list[dict[str, str]], max_tokens: int) -> dict:
        body = {"model": name, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        response = client.post("/chat/completions", json=body)
        assert response.status_code == 200, response.text
        data = response.json()
        usage = data["usage"]
        return {
            "text": data["choices"][0]["message"]["content"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"],
            "prompt": usage["prompt_tokens"],
        }

    def prefill() -> dict[str, int]:
        return httpx.get(base.removesuffix("/v1") + "/health", timeout=30).json()["prefill"]

    before = prefill()  # the warm-up's, on rank 0
    with httpx.Client(base_url=base, timeout=120) as client:
        turn1 = [{"role": "user", "content": "Tell me about the sea."}]
        first = chat(client, turn1, 8)
        turn2 = [
            *turn1,
            {"role": "assistant", "content": first["text"]},
            {"role": "user", "content": "And the sky?"},
        ]
        second = chat(client, turn2, 8)
        together = [
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            for q in QUESTIONS
        ]
        with ThreadPoolExecutor(len(together)) as pool:
            at_once = list(pool.map(lambda m: chat(client, m, 6), together))
    work = {key: n - before[key] for key, n in prefill().items()}
    return {"turns": [first, second], "at_once": at_once, "prefill": work}


def serve_split(model: Path, split: list[int], tmp: Path) -> tuple[str, list[subprocess.Popen]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), REEXEC_MARKER: "1"}
    return split_testing.serve_split(model, split, tmp, env)


@pytest.fixture(scope="module")
def expected(model: Path) -> dict[str, Any]:
    """The unsplit worker with rank 0's engine settings, the same script."""
    with run_worker_in_thread(model, config=leader_config([1], 2 << 30)) as (base, _):
        return script(base, model.name)


@pytest.mark.parametrize("split", [[3, 3], [2, 1, 3]], ids=["2-ranks", "3-ranks"])
def test_a_split_keeps_the_prompt_cache_and_the_unsplit_answers(
    model: Path, expected: dict[str, Any], split: list[int], tmp_path: Path
) -> None:
    first, second = expected["turns"]
    assert first["cached"] == 0 and second["cached"] > 0, "the reference must hit the cache"
    base, procs = serve_split(model, split, tmp_path)
    try:
        got = script(base, model.name)
    finally:
        procs[0].terminate()  # stopped like any worker; the others see the group break
        codes = [proc.wait(timeout=30) for proc in procs]
    # The second turn ran on the first one's KV (the followers' copy of it too, or its
    # answer would differ), with the same count of cached tokens.
    assert got["turns"] == expected["turns"]
    assert [a["text"] for a in got["at_once"]] == [a["text"] for a in expected["at_once"]]
    # Those three started from a sibling's prefill or from the first one's cached prompt
    # (which depends on when each arrived): not every one ran the shared system prompt.
    reused = got["prefill"]["shared_tokens"] + sum(a["cached"] for a in got["at_once"])
    assert reused >= min(a["prompt"] for a in got["at_once"]) // 2
    assert codes[1:] == [GROUP_BROKEN] * (len(split) - 1)
