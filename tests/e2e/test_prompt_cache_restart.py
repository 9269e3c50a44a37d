"""A node restarted – stopped with SIGTERM, or killed with SIGKILL – still has a conversation's
prefix: its worker's disk tier (``<home>/cache/<model>/``) serves the next turn's prompt, and the
answer is the one a cold node gives, token for token at temperature 0 (issue #45)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
from mesh_processes import Running

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

SYSTEM = "You are an agent. " + " ".join(
    f"file_{i}.py holds part {i} of the code." for i in range(60)
)
TURN1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where are the tests?"}]


def chat(url: str, messages: list[dict]) -> tuple[str, int, int]:
    body = {"model": "model", "messages": messages, "max_tokens": 12, "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()
    usage = data["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return data["choices"][0]["message"]["content"], usage["prompt_tokens"], cached


def on_disk(home: Path) -> list[Path]:
    return list((home / "cache").glob("*/*.json"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_the_next_turn_after_a_restart_reads_its_prefix_from_disk(
    tiny_model_dir: Path, tmp_path: Path, how: signal.Signals
) -> None:
    flags = ("--model", str(tiny_model_dir), "--prompt-cache-disk-gb", "1")
    home = tmp_path / "node"
    node = Running(home, *flags)
    try:
        answer, prompt_tokens, _ = chat(node.url, TURN1)
        assert prompt_tokens >= 256  # long enough to be written while it is hot
        deadline = time.monotonic() + 30
        while not on_disk(home):  # the commit and its write land after the answer
            assert time.monotonic() < deadline, "nothing reached the disk tier"
            time.sleep(0.1)
    finally:
        if how is signal.SIGKILL:
            node.kill()
            (home / "node.json").unlink()  # a killed node leaves it: wait for the new one's
        else:
            node.stop()
    turn2 = [*TURN1, {"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    again = Running(home, *flags)
    try:
        warm_text, warm_prompt, warm_cached = chat(again.url, turn2)
    finally:
        again.stop()
    cold = Running(tmp_path / "cold", "--model", str(tiny_model_dir), "--prompt-cache-disk-gb", "0")
    try:
        cold_text, cold_prompt, cold_cached = chat(cold.url, turn2)
    finally:
        cold.stop()
    assert warm_prompt == cold_prompt and cold_cached == 0
    assert warm_cached >= prompt_tokens - 1  # turn 1's prompt (at least) came back from disk
    assert warm_text == cold_text
