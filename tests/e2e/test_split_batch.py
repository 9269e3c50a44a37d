"""Rank 0 of a split group batches concurrent requests (worker/split/cache.py replays
mlx-lm's batch-cache operations on the followers): over 2 real rank processes (MLX ring backend
on loopback), four streamed requests at once decode side by side, not one after another, and
every answer at temperature 0 is the unsplit batching worker's, request for request."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx
import orjson
import pytest

from mesh.split.testing import serve_split
from worker.cpu.fast_path import REEXEC_MARKER
from worker.serve.split_rank import GROUP_BROKEN, leader_config
from worker.testing import make_tiny_model, run_worker_in_thread

mx = pytest.importorskip("mlx.core")
if not mx.distributed.is_available("ring"):
    pytest.skip("this MLX build has no ring backend (mx.distributed)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = ["Name a river.", "Tell me about mountains, briefly.", "Hi.", "Count to five."]
MAX_TOKENS = 24
BESIDE = 4  # tokens a request must get while another is still decoding: side by side


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("split-batch") / "m", num_layers=4)


def at_once(base: str, name: str) -> tuple[list[str], list[list[int]]]:
    """Stream every question at once. Each answer's text, and for each the order (among all
    the chunks every stream received) of its content chunks."""
    lock = threading.Lock()
    order: list[int] = []  # the request of each content chunk, as they arrived
    texts = [""] * len(QUESTIONS)
    start = threading.Barrier(len(QUESTIONS))
    errors: list[BaseException] = []

    def ask(i: int) -> None:
        body = {
            "model": name,
            "messages": [{"role": "user", "content": QUESTIONS[i]}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
        }
        try:
            with httpx.Client(base_url=base, timeout=120) as client:
                start.wait()
                with client.stream("POST", "/chat/completions", json=body) as response:
                    assert response.status_code == 200
                    for line in response.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        for choice in orjson.loads(line[6:]).get("choices", []):
                            if piece := (choice.get("delta") or {}).get("content"):
                                with lock:
                                    texts[i] += piece
                                    order.append(i)
        except BaseException as exc:  # the test thread reports it
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    positions = [[n for n, who in enumerate(order) if who == i] for i in range(len(QUESTIONS))]
    return texts, positions


def side_by_side(positions: list[list[int]]) -> bool:
    """Whether some request got :data:`BESIDE` chunks between another's first and last (one
    after another, none would: the next starts when the one before has finished)."""
    for i, mine in enumerate(positions):
        for j, theirs in enumerate(positions):
            if i != j and mine and theirs:
                inside = [n for n in theirs if mine[0] < n < mine[-1]]
                if len(inside) >= BESIDE:
                    return True
    return False


def test_a_split_batches_concurrent_requests_with_the_unsplit_answers(
    model: Path, tmp_path: Path
) -> None:
    with run_worker_in_thread(model, config=leader_config([1], 2 << 30)) as (base, _):
        expected, _ = at_once(base, model.name)
    env = {**os.environ, "PYTHONPATH": str(ROOT), REEXEC_MARKER: "1"}
    url, procs = serve_split(model, [2, 2], tmp_path, env)
    try:
        got, positions = at_once(url, model.name)
    finally:
        procs[0].terminate()
        codes = [proc.wait(timeout=30) for proc in procs]
    assert got == expected
    assert all(len(p) >= BESIDE for p in positions), positions  # long enough to overlap
    assert side_by_side(positions), positions
    assert codes[1:] == [GROUP_BROKEN]


def test_one_after_another_is_not_side_by_side() -> None:
    """The check above can fail: streams that ran one after another."""
    assert not side_by_side([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    assert side_by_side([[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]])
