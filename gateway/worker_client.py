"""``WorkerClient``: every call to one worker's HTTP API, over one long-lived connection pool.

It is the :class:`~gateway.upstream.Upstream` for the worker's model (ChatRequest → OpenAI
chat-completions body + the worker's extensions; streamed chunks → internal events; connection
refused before any byte → ``Error(unavailable, retryable)``; no first token or too long a gap
after it (:class:`~gateway.deadlines.StreamDeadlines`) → ``Error(timeout)``, retryable while
nothing was produced; cancelling the consumer closes the HTTP response, which stops the
worker's generation), and it also counts tokens, reads the worker's health and model
description, and waits for a starting worker to be ready. Every call has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

import httpx
import orjson

from gateway.deadlines import StreamDeadlines
from gateway.events import (
    RETRYABLE_KINDS,
    Done,
    Error,
    Event,
    Meta,
    ReasoningDelta,
    Sampling,
    TextDelta,
    TokenLogprob,
    ToolCallDelta,
    Usage,
    kind_for_status,
)
from gateway.request import ChatRequest, Message, OutputFormat
from gateway.upstream import ModelInfo, Upstream

log = logging.getLogger(__name__)

_FINISH = {"stop", "length", "tool_calls", "content_filter"}


def _message(m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.reasoning:
        out["reasoning_content"] = m.reasoning
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def worker_body(request: ChatRequest, model_name: str) -> dict[str, Any]:
    """The worker request for ``request``: always streamed, usage always included – in every
    chunk, so the prompt's size is known with the first token (Anthropic's message_start)."""
    body: dict[str, Any] = {
        "model": model_name,
        "messages": [_message(m) for m in request.messages],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if request.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                },
            }
            for t in request.tools
        ]
        if request.tool_choice is not None:
            body["tool_choice"] = request.tool_choice
    optional = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "seed": request.seed,
        "max_tokens": request.max_tokens,
        "repetition_penalty": request.repetition_penalty,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "reasoning_effort": request.reasoning_effort,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    if request.stop:
        body["stop"] = request.stop
    if request.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in request.logit_bias.items()}
    kwargs = dict(request.chat_template_kwargs)
    if request.reasoning is not None:
        kwargs.setdefault("enable_thinking", request.reasoning)
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    # MoA's candidates ask through metadata: each delta's mean log-probability scores them.
    if request.logprobs or request.metadata.get("logprobs"):
        body["logprobs"] = True
        if request.top_logprobs:
            body["top_logprobs"] = request.top_logprobs
    if request.temperature is None and request.min_temperature is not None:
        body["min_temperature"] = request.min_temperature  # model=mesh's vote samples
    if not request.cache_next_turn:
        body["cache_next_turn"] = False
    if request.output_format is not None:
        body["response_format"] = _response_format(request.output_format)
    return body


def _response_format(output: OutputFormat) -> dict[str, Any]:
    if output.json_schema is None:
        return {"type": "json_object"}
    spec: dict[str, Any] = {"name": output.name or "response", "schema": output.json_schema}
    if output.strict is not None:
        spec["strict"] = output.strict
    return {"type": "json_schema", "json_schema": spec}


class ChunkDecoder:
    """Worker ``chat.completion.chunk`` payloads → internal events (pure: no I/O).

    Usage goes out at the end; when the worker also counts in its chunks
    (``continuous_usage_stats``), an early ``Usage`` precedes the first delta too, so encoders
    can tell the prompt's size before the answer; with ``running_count`` each later count
    follows its chunk's deltas too: a stream that is cut off (the client left) has told the
    gateway how many tokens its text took, and the request log counts those, not the first
    one. (An answer the client waits for whole has no use for them: its cut-off text is
    never sent.) The worker's ``sampling`` extension (the values it used) becomes a
    ``Sampling`` right before ``Done``.
    """

    def __init__(self, running_count: bool = True) -> None:
        self.finish_reason = "stop"
        self.stop_sequence: str | None = None
        self.usage: Usage | None = None
        self.sampling: Sampling | None = None
        self._started = False  # a delta or the early usage went out
        self._running_count = running_count
        self._told: Usage | None = None  # the last count that went out

    def decode(self, payload: dict[str, Any]) -> list[Event]:
        if "error" in payload:
            err = (
                payload["error"]
                if isinstance(payload["error"], dict)
                else {"message": str(payload["error"])}
            )
            return [
                Error(
                    kind="upstream",
                    message=str(err.get("message", "worker error")),
                    code=err.get("code"),
                )
            ]
        events: list[Event] = []
        if isinstance(used := payload.get("sampling"), dict):
            self.sampling = _sampling(used)
        counted = self._count(payload.get("usage"), answering=bool(payload.get("choices")))
        if counted is not None and not self._started:
            events.append(counted)  # the early one: before the first delta
            counted = None
        for choice in payload.get("choices") or ():
            delta = choice.get("delta") or {}
            if reasoning := delta.get("reasoning_content"):
                events.append(ReasoningDelta(reasoning))
            if content := delta.get("content"):
                events.append(TextDelta(content, logprobs=_token_logprobs(choice.get("logprobs"))))
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                events.append(
                    ToolCallDelta(
                        index=int(call.get("index", 0)),
                        id=call.get("id"),
                        name=function.get("name"),
                        arguments=function.get("arguments") or "",
                    )
                )
            self._started = self._started or len(events) > 0
            if (finish := choice.get("finish_reason")) in _FINISH:
                self.finish_reason = finish
                # vLLM-style extension: the stop string that matched (a token id is not one).
                stop = choice.get("stop_reason")
                self.stop_sequence = stop if isinstance(stop, str) and finish == "stop" else None
        if counted is not None and self._running_count:
            events.append(counted)
        return events

    def _count(self, usage: Any, answering: bool) -> Usage | None:
        """Note a chunk's ``usage``; returns it when a chunk of the answer (``answering``)
        brought a new count. The last chunk's, usage only, is ``finish``'s to report."""
        if not usage:
            return None
        details = usage.get("prompt_tokens_details") or {}
        self.usage = Usage(
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            cached_tokens=int(details.get("cached_tokens") or 0),
        )
        if not answering or self.usage == self._told:
            return None
        self._told = self.usage
        return self.usage

    def finish(self) -> list[Event]:
        tail: list[Event] = [e for e in (self.usage, self.sampling) if e is not None]
        done = Done(self.finish_reason, self.stop_sequence)  # type: ignore[arg-type]
        return [*tail, done]


def _sampling(used: dict[str, Any]) -> Sampling | None:
    try:
        return Sampling(float(used["temperature"]), float(used["top_p"]), int(used.get("top_k", 0)))
    except (KeyError, TypeError, ValueError):
        return None  # not what our worker sends: say nothing rather than something wrong


def _token_logprobs(logprobs: Any) -> tuple[TokenLogprob, ...] | None:
    """A chunk's ``logprobs.content`` as entries (None when it has none); an entry that is not
    what our worker writes is left out rather than guessed at."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return None
    entries = []
    for entry in content:
        with contextlib.suppress(KeyError, TypeError, ValueError, AttributeError):
            entries.append(TokenLogprob.from_wire(entry))
    return tuple(entries) or None


class _Call:
    """One streamed call's hand-over from its exchange task to the consumer."""

    def __init__(self) -> None:
        # Unbounded, like the engine's own job queue: the answer is bounded by max_tokens.
        self.events: asyncio.Queue[Event | None] = asyncio.Queue()
        self.reading = True  # the exchange may be waiting for the worker: cancelling stops it


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a failed exchange's exception as seen (its consumer re-raises it, if still there)."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("worker exchange failed: %r", task.exception())


class WorkerClient(Upstream):
    """One worker's API; ``name`` goes into route headers ("local")."""

    def __init__(
        self,
        base_url: str,
        model_name: str,
        *,
        name: str = "local",
        client: httpx.AsyncClient | None = None,
        connect_timeout_s: float = 5.0,
        secret: str | None = None,
        deadlines: StreamDeadlines | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model_name = model_name
        self.name = name
        self.deadlines = deadlines or StreamDeadlines()
        # The worker's per-start secret (mesh.workers): without it the worker answers 401.
        headers = {"authorization": f"Bearer {secret}"} if secret else None
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(connect=connect_timeout_s, read=None, write=30.0, pool=30.0),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=32),
            headers=headers,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def stream(self, request: ChatRequest) -> AsyncGenerator[Event, None]:
        """The worker's answer as events. The HTTP exchange runs in a task of its own that only
        this generator cancels, and at most once: httpx leaves the connection open when the task
        closing a response is cancelled again meanwhile (encode/httpcore#1115), and the worker
        would then generate to ``max_tokens`` for nobody. A consumer cancelled twice (a tunnel
        lost while the peer cancels, a MoA loser cancelled and then closed) no longer can."""
        call = _Call()
        exchange = asyncio.create_task(self._exchange(request, call), name="worker-exchange")
        exchange.add_done_callback(_retrieve)
        try:
            while (event := await call.events.get()) is not None:
                yield event
        finally:
            if call.reading:
                exchange.cancel()  # the consumer left mid-answer: closing the HTTP response stops it
            await asyncio.wait([exchange])  # a cancel of ours does not cut its close short
        if not exchange.cancelled() and (exc := exchange.exception()) is not None:
            raise exc  # a bug in the exchange surfaces where it would have inline

    async def _exchange(self, request: ChatRequest, call: _Call) -> None:
        try:
            async for event in self._events(request, call):
                call.events.put_nowait(event)
        finally:
            call.reading = False
            call.events.put_nowait(None)

    async def _events(self, request: ChatRequest, call: _Call) -> AsyncGenerator[Event, None]:
        body = orjson.dumps(worker_body(request, self.model_name))
        url = f"{self.base_url}/v1/chat/completions"
        decoder = ChunkDecoder(running_count=request.stream)
        produced = False  # nothing reached the client yet: a broken connection is retryable
        deadlines = self.deadlines
        clock = asyncio.get_running_loop().time
        started = clock()
        heard: float | None = None  # when the worker last sent an answer line
        try:
            # One timer per stream, moved on by each line: a stopped worker cannot hold it.
            async with asyncio.timeout_at(deadlines.due(started, None)) as deadline:
                async with self._client.stream(
                    "POST", url, content=body, headers={"content-type": "application/json"}
                ) as response:
                    try:
                        if response.status_code != 200:
                            yield await _status_error(response)
                            return
                        if listing := response.headers.get("x-tools-listing"):
                            yield Meta({"x-tools-listing": listing})  # tools shortened to fit
                        async for line in response.aiter_lines():
                            if not line.startswith("data:"):
                                continue
                            heard = clock()
                            deadline.reschedule(deadlines.due(started, heard))
                            events, final = _line_events(decoder, line[5:].strip(), produced)
                            produced = produced or bool(events)
                            for event in events:
                                yield event
                            if final:
                                return
                    finally:
                        # From here on the response only closes: a cancel now would cut it short.
                        call.reading = False
            yield _broken("the worker closed the stream before [DONE]", produced)
        except TimeoutError:
            # Closing the response closed its connection: the worker stops this job, if it can.
            message = deadlines.missed(heard is not None)
            log.warning("worker %s: %s", self.model_name, message)
            yield Error(kind="timeout", message=message, retryable=not produced)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            yield Error(kind="unavailable", message=f"worker unreachable: {exc}", retryable=True)
        except httpx.HTTPError as exc:
            yield _broken(f"worker connection failed: {type(exc).__name__}: {exc}", produced)
        except orjson.JSONDecodeError as exc:
            yield Error(kind="upstream", message=f"worker sent malformed JSON: {exc}")

    async def count_tokens(self, request: ChatRequest) -> int | None:
        """Prompt tokens by the worker's own tokenizer and chat template (a 1-token request,
        which also warms the prompt cache); None when the worker cannot be reached."""
        probe = request.model_copy(update={"max_tokens": 1, "stream": True})
        async with contextlib.aclosing(self.stream(probe)) as events:
            async for event in events:
                if isinstance(event, Usage):
                    return event.prompt_tokens
                if isinstance(event, Error | Done):
                    return None
        return None

    async def prompt_blocks(self, request: ChatRequest) -> dict[str, Any] | None:
        """The request's prompt as cache-digest block hashes (``block_size``, ``prompt_tokens``,
        ``hashes``: worker/chat/prompt_blocks.py), or None when the worker cannot tell."""
        body = worker_body(request, self.model_name)
        try:
            response = await self._client.post(f"{self.base_url}/v1/prompt_blocks", json=body, timeout=10.0)  # fmt: skip
            data = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return data if isinstance(data, dict) and isinstance(data.get("hashes"), list) else None

    async def prefix_held(
        self, block_size: int, hashes: list[int], timeout_s: float = 1.0
    ) -> dict[str, Any] | None:
        """How much of a prompt (its block hashes) the worker's prompt cache holds now or is
        about to (a pending commit), with its load: ``held_tokens``, ``disk_tokens`` (of them,
        those to restore from disk), ``restore_tok_s``, ``queue_depth``, ``in_flight``,
        ``prefill_backlog``, ``prefill_tok_s``; None when it does not answer in time."""
        body = {"block_size": block_size, "hashes": hashes}
        try:
            response = await self._client.post(f"{self.base_url}/v1/prompt_cache/held", json=body, timeout=timeout_s)  # fmt: skip
            if response.status_code != 200:
                return None
            data = response.json()
            warm = max(int(data["memory_tokens"]), int(data["pending_tokens"]))
            held = max(warm, int(data["cached_tokens"]))
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
        rate = data.get("prefill_tok_s")
        return {
            "held_tokens": held,
            # Held only on disk beyond memory: a restore (a read) before the prefill of the rest.
            "disk_tokens": held if held > warm else 0,
            "restore_tok_s": data.get("restore_tok_s"),
            "queue_depth": data.get("queue_depth"),
            "in_flight": data.get("in_flight"),
            "prefill_backlog": data.get("prefill_backlog"),
            "prefill_tok_s": rate,
        }

    async def health(self, timeout_s: float = 2.0) -> dict[str, Any] | None:
        """The worker's ``/health`` body, or None when it does not answer 200 with JSON within
        ``timeout_s`` (a stopped worker accepts the connection and never answers)."""
        try:
            response = await self._client.get(f"{self.base_url}/health", timeout=timeout_s)
            return response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def wait_ready(self, alive: Callable[[], bool], poll_s: float = 0.05) -> bool:
        """Poll ``/health`` until it answers (True) or ``alive()`` says the worker died (False)."""
        while alive():
            if await self.health() is not None:
                return True
            await asyncio.sleep(poll_s)
        return False

    async def describe(self) -> ModelInfo:
        """The worker's own description of its model (context length, size), for /v1/models."""
        try:
            response = await self._client.get(f"{self.base_url}/v1/models", timeout=5.0)
            data = response.json()["data"][0]
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
            log.warning("worker %s did not describe its model: %s", self.model_name, exc)
            return ModelInfo(id=self.model_name)
        return ModelInfo(
            id=self.model_name,
            architecture=str(data.get("architecture") or "unknown"),
            parameters=data.get("parameters"),
            context_length=data.get("context_length"),
            capabilities=dict(data.get("capabilities") or {}),
        )


def _broken(message: str, produced: bool) -> Error:
    """The worker's answer broke off. Before any output the worker went away (killed, its
    split group broken): unavailable, retryable – 503 with Retry-After when no other route
    answers. After it, the answer so far is all there is (502)."""
    if produced:
        return Error(kind="upstream", message=message)
    return Error(kind="unavailable", message=message, retryable=True)


def _line_events(decoder: ChunkDecoder, data: str, produced: bool) -> tuple[list[Event], bool]:
    """The events of one ``data:`` line, and whether the answer ends with them.

    A worker that fails a job before any output (its engine's step failed, its split group
    broke, it shuts down) is in trouble, not the request (one it refuses is a 4xx before the
    stream): that is ``unavailable`` and retryable, so another route may answer, else the
    client gets 503 with Retry-After."""
    if data == "[DONE]":
        return decoder.finish(), True
    events = decoder.decode(orjson.loads(data))
    if not events or not isinstance(failed := events[-1], Error):
        return events, False
    if not produced:
        events[-1] = Error("unavailable", failed.message, retryable=True, code=failed.code)
    return events, True


async def _status_error(response: httpx.Response) -> Error:
    raw = await response.aread()
    message = raw.decode(errors="replace")[:500]
    code = param = None
    try:
        err = orjson.loads(raw).get("error", {})
        message = str(err.get("message", message))
        code = err.get("code")
        param = err.get("param")
    except (orjson.JSONDecodeError, AttributeError):
        pass  # not JSON: the raw text is the message
    status = response.status_code
    kind = kind_for_status(status)
    # The field a worker's 400 names (a schema keyword the grammar cannot hold, say) goes on.
    details = {"param": param} if kind == "invalid_request" and param else {}
    return Error(
        kind=kind, message=message, retryable=kind in RETRYABLE_KINDS, code=code, details=details
    )
