"""The start-up warm-up: short chat requests through the worker's own app before it is announced.

The first request after a start used to take seconds longer than the next ones. MLX builds
compiled kernels lazily, on first use (on the Linux CPU backend it compiles C++ and caches the
result under ``$TMPDIR/mlx``, ~1 s a kernel; Metal compiles shaders), and the HTTP path has
first-call costs of its own (anyio's lazy imports, the thread pool the chat template runs in,
~40 ms). ``warm_up`` pays them before ``serve`` prints ``worker listening on``, which is what
the node waits for: two streamed requests at once through the app in-process (no socket), so
the same path a user's request takes, chat template and batch generator included. One samples
with the model's defaults, one with every sampling filter on, so a request with its own values
finds those kernels built too (greedy decoding builds none).

Afterwards the engine discards the requests' KV caches and their throughput: their prompts
share the chat template's opening with every user's and would otherwise be reported as the
first user's ``cached_tokens``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette

from worker.engine.types import EngineError

MESSAGES = [{"role": "user", "content": "Hi"}]
# Every filter the sampler has, at values no model recommends (each value shares its kernel).
ALL_FILTERS = {"temperature": 1.0, "top_p": 0.9, "top_k": 40, "min_p": 0.05}


async def warm_up(
    app: Starlette, *, secret: str | None = None, max_tokens: int = 4, timeout_s: float = 600.0
) -> None:
    """Run the warm-up requests through ``app`` (the worker app over a started engine) and
    record it in the engine's stats (``warm_up_s``, ``warm_up_tokens``); EngineError if a
    request fails."""
    engine = app.state.engine
    started = time.monotonic()
    base: dict[str, Any] = {
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"authorization": f"Bearer {secret}"} if secret else None
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://warm-up", headers=headers
    ) as client:
        try:
            async with asyncio.timeout(timeout_s):
                replies = await asyncio.gather(
                    client.post("/v1/chat/completions", json=base),
                    client.post("/v1/chat/completions", json=base | ALL_FILTERS),
                )
        except TimeoutError:
            raise EngineError(f"the warm-up did not finish in {timeout_s:.0f}s") from None
    # The app requested each commit before its response ended: the discard comes after them.
    engine.discard_prompt_cache()
    engine.stats.warm_up_tokens = sum(_completion_tokens(reply) for reply in replies)
    engine.stats.warm_up_s = time.monotonic() - started


def _completion_tokens(reply: httpx.Response) -> int:
    """The tokens a streamed warm-up reply generated; EngineError when it failed."""
    if reply.status_code != 200:
        raise EngineError(f"the warm-up request failed ({reply.status_code}): {reply.text:.300}")
    tokens = None
    for line in reply.text.splitlines():
        if not line.startswith("data: {"):
            continue
        chunk = orjson.loads(line[6:])
        if "error" in chunk:
            raise EngineError(f"the warm-up generation failed: {chunk['error'].get('message')}")
        if chunk.get("usage"):
            tokens = int(chunk["usage"]["completion_tokens"])
    if tokens is None:
        raise EngineError("the warm-up stream ended without its usage")
    return tokens
