"""The routing-time question to a peer: how much of this prompt do you hold right now?

Gossip carries each node's cache digest every interval (2 s), later than an agent's next turn:
a conversation whose turn 1 ran on one member and whose turn 2 enters at another found nothing
by gossip and recomputed its whole prompt. So while routing a conversation's next turn, the entry
node asks the members that serve the model, with a short deadline, one stream each::

    → RequestHead{path=/mesh/v1/prefix-held, deadline}
      Body({"model", "block_size", "hashes"}) BodyEnd
    ← ResponseHead{200} Data({"held_tokens", "disk_tokens", "restore_tok_s", "queue_depth",
                              "in_flight", "prefill_backlog", "prefill_tok_s"}) End
    ← ResponseHead{4xx} End                                 a question it cannot answer

The answering node asks its own worker (``POST /v1/prompt_cache/held``), which answers from its
digest and its pending commits without waiting for the engine, with its load and its measured
prefill rate now (gossip's are as old as its digest). A question that gets no answer within its
deadline counts for nothing: routing goes on with what gossip said.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.upstream import ModelDirectory
from mesh.errors import MeshError
from mesh.tunnel.frames import Body, BodyEnd, Data, End, RequestHead, ResponseHead
from worker.chat.prompt_blocks import MAX_HELD_HASHES

log = logging.getLogger(__name__)

HELD_PATH = "/mesh/v1/prefix-held"
MAX_HASHES = MAX_HELD_HASHES  # the worker's own bound, one figure for both ends
MAX_BODY_BYTES = MAX_HASHES * 22 + 1024  # JSON of u64s: at most 21 bytes each
WORKER_TIMEOUT_S = 1.0


def question(model: str, block_size: int, hashes: list[int]) -> bytes:
    return orjson.dumps({"model": model, "block_size": block_size, "hashes": hashes})


def parse_question(body: bytes) -> tuple[str, int, list[int]]:
    """``(model, block_size, hashes)``; ValueError for anything else."""
    try:
        data = orjson.loads(body)
        model, size, hashes = data["model"], int(data["block_size"]), data["hashes"]
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError("not a prefix question") from exc
    if not isinstance(model, str) or not isinstance(hashes, list) or len(hashes) > MAX_HASHES:
        raise ValueError("not a prefix question")
    if size <= 0 or not all(isinstance(h, int) and 0 <= h < 1 << 64 for h in hashes):
        raise ValueError("not a prefix question")
    return model, size, hashes


@dataclass(frozen=True, slots=True)
class Held:
    """A node's answer: the prompt's tokens it holds, and its load and prefill rate now."""

    tokens: int
    queue_depth: int | None = None
    in_flight: int | None = None
    prefill_backlog: int | None = None  # prompt tokens its queue still has to prefill
    prefill_tok_s: float | None = None
    disk_tokens: int = 0  # of ``tokens``, those a restore from its disk tier reads back first
    restore_tok_s: float | None = None  # the rate its last restores ran at

    @classmethod
    def parse(cls, data: Any) -> Held | None:
        """From a worker's or a peer's answer (a dict); None for anything unusable."""
        if not isinstance(data, dict):
            return None
        tokens = data.get("held_tokens")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            return None
        return cls(
            tokens,
            _count(data.get("queue_depth")),
            _count(data.get("in_flight")),
            _count(data.get("prefill_backlog"), 1 << 30),
            _rate(data.get("prefill_tok_s")),
            min(tokens, _count(data.get("disk_tokens"), 1 << 30) or 0),
            _rate(data.get("restore_tok_s")),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "held_tokens": self.tokens,
            "queue_depth": self.queue_depth,
            "in_flight": self.in_flight,
            "prefill_backlog": self.prefill_backlog,
            "prefill_tok_s": self.prefill_tok_s,
            "disk_tokens": self.disk_tokens,
            "restore_tok_s": self.restore_tok_s,
        }


def _count(value: Any, bound: int = 1 << 20) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < bound
    return value if ok else None


def _rate(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 1e9
    return float(value) if ok else None


def parse_answer(body: bytes) -> Held | None:
    try:
        return Held.parse(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None


async def held_here(local: ModelDirectory, model: str, block_size: int, hashes: list[int]) -> Held | None:  # fmt: skip
    """What this node's own worker for ``model`` holds of the prompt (None: no worker answers)."""
    for route in local.routes(model, None):
        ask = getattr(route.upstream, "prefix_held", None)
        if ask is not None:
            return Held.parse(await ask(block_size, hashes, WORKER_TIMEOUT_S))
    return None


async def _reply(stream: Any, status: int, payload: bytes = b"") -> None:
    await stream.send(ResponseHead(status=status))
    if payload:
        await stream.send(Data(payload))
    await stream.send(End())


async def serve(stream: Any, local: ModelDirectory) -> None:
    """Answer one peer's question (the tunnel server's handler for :data:`HELD_PATH`)."""
    body = await stream.read_body(MAX_BODY_BYTES)
    if body is None:
        await _reply(stream, 413)
        return
    try:
        model, size, hashes = parse_question(body)
    except ValueError:
        await _reply(stream, 400)
        return
    held = await held_here(local, model, size, hashes)
    if held is None:
        await _reply(stream, 404)
        return
    await _reply(stream, 200, orjson.dumps(held.to_dict()))


async def ask(conn: Any, model: str, block_size: int, hashes: list[int], timeout_s: float) -> Held | None:  # fmt: skip
    """Ask one peer over its link; None when it cannot say within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            stream = await conn.open_stream()
            head = RequestHead(id=secrets.token_hex(8), path=HELD_PATH, deadline=timeout_s)
            await stream.send(head)
            await stream.send(Body(question(model, block_size, hashes)))
            await stream.send(BodyEnd())
            first = await stream.recv()
            if not isinstance(first, ResponseHead) or first.status != 200:
                return None
            data = bytearray()
            async for frame in stream:
                if isinstance(frame, Data):
                    data += frame.data
                    if len(data) > 1024:
                        return None
                elif isinstance(frame, End):
                    break
            return parse_answer(bytes(data))
    except (MeshError, OSError, TimeoutError) as exc:
        log.debug("prefix question to a peer unanswered: %s", exc)
        return None
