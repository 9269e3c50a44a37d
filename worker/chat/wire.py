"""An engine job as OpenAI chat completions: the SSE chunks of a stream, or the one JSON body.

The prompt-cache commit is requested only after the terminal frame (``[DONE]``) went out; a
client gone before it cancels the job.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request

from worker.chat.next_turn import NextTurn, commit_soon
from worker.chat.output import DeltaAssembler
from worker.chat.schemas import openai_usage
from worker.engine.core import Engine, Job
from worker.engine.types import Failed, Finished, TokenChunk, TokenLogprob


def sampling_used(job: Job) -> dict[str, Any]:
    """The ``sampling`` extension: the values this answer was generated with."""
    params = job.request.sampling
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
    }


def _usage(done: Finished) -> dict[str, Any]:
    return openai_usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)


def _alternative(token: str, logprob: float) -> dict[str, Any]:
    # ``bytes``: the token text's UTF-8 (a token that is part of a character is U+FFFD here).
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def logprobs_body(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's choice ``logprobs``: each token with its ``top_logprobs``."""
    content = [
        _alternative(e.token, e.logprob) | {"top_logprobs": [_alternative(*t) for t in e.top]}
        for e in logprobs
    ]
    return {"content": content, "refusal": None}


# Like vLLM, the final choice also carries ``stop_reason``: the stop string that ended the
# answer, or null. Plain OpenAI clients ignore it; the gateway maps it to Anthropic's
# ``stop_sequence``.
def _finish_reason(assembler: DeltaAssembler, done: Finished) -> str:
    # A call cut off by max_tokens was already streamed as a call: "length" says it is cut.
    if assembler.tool_calls and done.finish_reason != "length":
        return "tool_calls"
    return done.finish_reason


async def sse_frames(  # noqa: C901 - to be split (complexity gate, issue 10)
    engine: Engine,
    job: Job,
    assembler: DeltaAssembler,
    meta: dict[str, Any],
    include_usage: bool,
    continuous_usage: bool = False,
    next_turn: NextTurn | None = None,
) -> AsyncIterator[bytes]:
    base = {**meta, "object": "chat.completion.chunk"}
    first = True
    pending_logprobs: list[TokenLogprob] = []
    prompt_tokens = len(job.request.prompt)
    completion_tokens = 0
    cached_tokens = 0

    def frame(delta: dict[str, Any], done: Finished | None = None) -> bytes:
        nonlocal first
        if first:
            delta = {"role": "assistant", **delta}
            first = False
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
        if done is not None:
            choice["finish_reason"] = _finish_reason(assembler, done)
            choice["stop_reason"] = done.stop_sequence
        if pending_logprobs:
            choice["logprobs"] = logprobs_body(pending_logprobs)
            pending_logprobs.clear()
        chunk = {**base, "choices": [choice]}
        if done is not None:
            chunk["sampling"] = sampling_used(job)
        if continuous_usage:
            chunk["usage"] = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens},
            }
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    out: list[bytes] = []
    try:
        async for event in job.events():
            if isinstance(event, TokenChunk):
                if event.logprobs:
                    pending_logprobs.extend(event.logprobs)
                completion_tokens = event.completion_tokens
                cached_tokens = event.cached_tokens
                out.extend(frame(delta) for delta in assembler.feed(event.text))
            elif isinstance(event, Finished):
                completion_tokens = event.completion_tokens
                out.extend(frame(delta) for delta in assembler.finish())
                out.append(frame({}, event))
                if include_usage:
                    usage = {**base, "choices": [], "usage": _usage(event)}
                    out.append(b"data: " + orjson.dumps(usage) + b"\n\n")
                out.append(b"data: [DONE]\n\n")
            else:
                error = {"message": event.message, "type": "server_error", "code": "internal"}
                out.append(b"data: " + orjson.dumps({"error": error}) + b"\n\n")
                out.append(b"data: [DONE]\n\n")
            # One write for everything already decoded: a fast model outruns per-frame sends.
            if out and (job.done or not job.has_ready()):
                yield b"".join(out)
                out.clear()
    finally:
        if job.done:
            # Runs only after [DONE] was handed to the transport (the generator resumes after
            # each send): the cache bookkeeping never delays the client.
            commit_soon(engine, job, next_turn, assembler.message())
        else:
            # Client gone before the end: stop generating now.
            engine.cancel(job)


async def _collect(job: Job, assembler: DeltaAssembler) -> tuple[Finished | Failed, list[Any]]:
    logprobs: list[TokenLogprob] = []
    async for event in job.events():
        if isinstance(event, TokenChunk):
            if event.logprobs:
                logprobs.extend(event.logprobs)
            assembler.feed(event.text)
        else:
            if isinstance(event, Finished):
                assembler.finish()
            return event, logprobs
    raise AssertionError("job ended without a terminal event")


async def collect_unless_disconnected(
    request: Request, engine: Engine, job: Job, assembler: DeltaAssembler
) -> tuple[Finished | Failed, list[Any]] | None:
    """The job's result, or None when the client went away first (then the job is cancelled)."""
    collect = asyncio.ensure_future(_collect(job, assembler))
    disconnect = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait([collect, disconnect], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collect, disconnect):
            if not task.done():
                task.cancel()
    if not collect.done() or collect.cancelled():
        engine.cancel(job)
        await asyncio.gather(collect, return_exceptions=True)
        return None
    return collect.result()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def completion_body(
    meta: dict[str, Any],
    assembler: DeltaAssembler,
    done: Finished,
    logprobs: list[TokenLogprob] | None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "message": assembler.message(),
        "finish_reason": _finish_reason(assembler, done),
        "stop_reason": done.stop_sequence,
        "logprobs": logprobs_body(logprobs) if logprobs is not None else None,
    }
    return {
        **meta,
        "object": "chat.completion",
        "choices": [choice],
        "usage": _usage(done),
    }
