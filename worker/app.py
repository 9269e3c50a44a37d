"""The worker's HTTP app: OpenAI chat completions (stream and not), /v1/models, /health.

``create_app(engine)`` builds the Starlette app over a started ``Engine``; ``serve`` runs it with
uvicorn. The prompt-cache commit is requested only after the terminal frame (``[DONE]`` or the
JSON body) went out; the engine makes the next request that needs it wait for it.

Sampling fields a request omits get the model's recommended values (``engine.sampling_defaults``,
listed in /v1/models); every answer says what it used in an extension object ``sampling``
(temperature, top_p, top_k, min_p): top-level in the JSON body, in the stream's finishing chunk.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import jinja2
import orjson
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from worker.engine import Engine, Job
from worker.engine_types import Failed, Finished, GenerationRequest, TokenChunk
from worker.net import bind_socket, server_limits
from worker.output import DeltaAssembler
from worker.prompt_blocks import prompt_blocks
from worker.sampling import SamplingParams
from worker.schemas import ChatCompletionRequest, describe_validation_error, openai_usage
from worker.structured.processor import GrammarProcessor
from worker.structured.response_format import (
    OutputFormatError,
    agrammar_processor,
    answer_prompt,
    output_grammar,
)
from worker.thinking import normalize_thinking
from worker.tools import listing as tool_listing
from worker.tools.listing import Listing
from worker.tools.parsing import ToolCallSplitter, parse_json_span

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 2048


def json_response(
    body: Any, status: int = 200, background: BackgroundTask | None = None
) -> Response:
    return Response(
        orjson.dumps(body), status_code=status, media_type="application/json", background=background
    )


def error_response(
    status: int, message: str, *, type_: str, param: str | None = None, code: str | None = None
) -> Response:
    error = {"message": message, "type": type_, "param": param, "code": code}
    return json_response({"error": error}, status)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def context_overflow(prompt_tokens: int, context: int) -> BadRequest:
    """The 400 for a prompt the model cannot hold. Its words are Anthropic's, which Claude Code
    parses to compact the conversation and retry (any other wording ends its session); OpenAI
    clients (OpenCode, Codex CLI) read the code, and OpenCode the words too."""
    return BadRequest(
        f"prompt is too long: {prompt_tokens} tokens > {context} maximum (the model's context"
        " length)",
        "messages",
        "context_length_exceeded",
    )


def create_app(engine: Engine, *, secret: str | None = None) -> Starlette:
    """The worker app over a started engine (the caller starts and closes the engine).

    With a ``secret`` every route wants ``Authorization: Bearer <secret>``: the node gives each
    worker it starts a random one, so no other local process can use the worker's port to get
    past the gateway's API key."""

    async def chat_completions(request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            return error_response(
                400, f"request body is not valid JSON: {exc}", type_="invalid_request_error"
            )
        if not isinstance(body, dict):
            return error_response(
                400, "request body must be a JSON object", type_="invalid_request_error"
            )
        try:
            chat = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            param, message = describe_validation_error(exc)
            return error_response(400, message, type_="invalid_request_error", param=param)
        if chat.model and chat.model not in (engine.name, engine.model_path):
            return error_response(
                404,
                f"model '{chat.model}' is not served here (this worker serves '{engine.name}')",
                type_="invalid_request_error",
                param="model",
                code="model_not_found",
            )
        try:
            job, assembler, listing = await _start_job(engine, chat, body)
        except BadRequest as exc:
            return error_response(
                400, str(exc), type_="invalid_request_error", param=exc.param, code=exc.code
            )
        meta = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "created": int(time.time()),
            "model": engine.name,
        }
        if chat.stream:
            options = chat.stream_options
            include_usage = bool(options and options.include_usage)
            continuous = bool(include_usage and options and options.continuous_usage_stats)
            frames = _sse_frames(engine, job, assembler, meta, include_usage, continuous)
            return StreamingResponse(
                frames,
                media_type="text/event-stream",
                headers={"cache-control": "no-cache", "x-accel-buffering": "no"}
                | _listing_header(listing),
            )
        collected = await _collect_unless_disconnected(request, engine, job, assembler)
        if collected is None:
            return Response(status_code=499)
        result, logprobs = collected
        if isinstance(result, Failed):
            return error_response(500, result.message, type_="server_error")
        body = _completion_body(meta, assembler, result, logprobs if chat.logprobs else None)
        body["sampling"] = _sampling_used(job)
        # The commit runs as a background task: after the body went out.
        response = json_response(body, background=BackgroundTask(engine.commit, job))
        response.headers.update(_listing_header(listing))
        return response

    async def models(_: Request) -> Response:
        info = engine.info
        entry = {
            "id": engine.name,
            "object": "model",
            "created": int(info.loaded_at),
            "owned_by": "mlx-mesh",
            "architecture": info.architecture,
            "parameters": info.parameters,
            "context_length": info.context_length,
            "quantization": info.quantization,
            "sampling_defaults": engine.sampling_defaults.as_dict(),
            "capabilities": {
                "tools": engine.tool_calling,  # native, or the generic tool prompt
                "thinking": bool(engine.tokenizer.has_thinking),
                "context_length": info.context_length,
            },
        }
        return json_response({"object": "list", "data": [entry | _how_it_runs(engine)]})

    async def health(_: Request) -> Response:
        stats = engine.stats
        return json_response(
            {
                "status": "ok",
                "model": engine.name,
                "queue_depth": stats.queue_depth,
                "in_flight": stats.in_flight,
                "tokens_per_second": round(engine.tokens_per_second(), 3),
                "uptime_s": round(engine.uptime_s, 3),
                "warm_up_s": _rounded(stats.warm_up_s),
                "cache_digest": engine.cache_digest.to_wire(),  # routing by prefix (mesh)
                "loops_stopped": stats.loops_stopped,
                # Prefill work since start (the warm-up's included): samples of one prompt
                # show up as one prefill and shared ones (worker/shared_prefill.py).
                "prefill": {
                    "prefills": stats.prefills,
                    "prompt_tokens_computed": stats.prompt_tokens_computed,
                    "shared": stats.shared_prefills,
                    "shared_tokens": stats.shared_prefill_tokens,
                },
            }
            | _how_it_runs(engine)
        )

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/prompt_blocks", prompt_blocks, methods=["POST"]),  # routing by prefix (mesh)
    ]
    app = Starlette(routes=routes, middleware=[Middleware(WorkerSecretGuard, secret=secret)])
    app.state.engine = engine
    return app


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _how_it_runs(engine: Engine) -> dict[str, Any]:
    """``cpu_fast_path`` (BLAS, GFLOP/s, dequantized) on the CPU backend; nothing elsewhere."""
    if engine.cpu_fast_path is None:
        return {}
    return {"cpu_fast_path": engine.cpu_fast_path.as_dict()}


async def _start_job(
    engine: Engine, chat: ChatCompletionRequest, body: dict[str, Any]
) -> tuple[Job, DeltaAssembler, Listing]:
    template_kwargs = dict(chat.chat_template_kwargs or {})
    thinking = normalize_thinking(body)
    if thinking is not None:
        template_kwargs["enable_thinking"] = thinking
    messages = [m.to_template() for m in chat.messages]
    # tool_choice "none": the model is not offered the tools, so it cannot call them.
    offered = chat.tools if chat.tool_choice != "none" else None
    tools = [t.model_dump(exclude_none=True) for t in offered] if offered else None
    grammar = _output_grammar(chat, bool(tools))
    if grammar is not None:
        template_kwargs["enable_thinking"] = (
            False  # the grammar holds the answer, not a think block
        )
    context = engine.info.context_length
    try:
        (prompt, in_reasoning), listing = await asyncio.to_thread(
            _fitted_prompt, engine, messages, tools, template_kwargs
        )
    except jinja2.TemplateError as exc:
        raise BadRequest(f"the chat template rejected the messages: {exc}", "messages") from exc
    if len(prompt) >= context:
        raise context_overflow(len(prompt), context)
    try:
        logit_bias = chat.logit_bias_ids()
    except ValueError as exc:
        raise BadRequest(str(exc), "logit_bias") from exc
    vocab = len(engine.tokenizer)
    if logit_bias and any(not 0 <= t < vocab for t in logit_bias):
        raise BadRequest(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
    processors: tuple[GrammarProcessor, ...] = ()
    if grammar is not None:
        prompt, in_reasoning = answer_prompt(engine.tokenizer, prompt, in_reasoning), False
        processors = (await _grammar_processor(engine, grammar),)
    limit = chat.max_completion_tokens or chat.max_tokens or DEFAULT_MAX_TOKENS
    defaults = engine.sampling_defaults  # for the fields the request leaves out
    sampling = SamplingParams(
        temperature=defaults.temperature if chat.temperature is None else chat.temperature,
        top_p=defaults.top_p if chat.top_p is None else chat.top_p,
        top_k=defaults.top_k if chat.top_k is None else chat.top_k,
        min_p=defaults.min_p if chat.min_p is None else chat.min_p,
        seed=chat.seed,
        repetition_penalty=chat.repetition_penalty,
        presence_penalty=chat.presence_penalty,
        frequency_penalty=chat.frequency_penalty,
        logit_bias=logit_bias,
    )
    job = engine.submit(
        GenerationRequest(
            prompt=prompt,
            max_tokens=max(1, min(limit, context - len(prompt))),
            sampling=sampling,
            stop=chat.stop_strings(),
            logprobs=bool(chat.logprobs),
            logits_processors=processors,
        )
    )
    tok = engine.tokenizer
    splitter = None
    if tools:
        if tok.has_tool_calling:
            splitter = ToolCallSplitter(
                start=tok.tool_call_start,
                end=tok.tool_call_end,
                parser=tok.tool_parser,
                tools=tools,
            )
        else:
            splitter = ToolCallSplitter(parser=parse_json_span, tools=tools)
    # A held answer is all content: a think tag spelled inside a JSON string stays in it.
    think_tags = (tok.think_start, tok.think_end) if tok.has_thinking and grammar is None else None
    assembler = DeltaAssembler(
        think_tags=think_tags, in_reasoning=in_reasoning, tool_splitter=splitter
    )
    return job, assembler, listing


def _listing_header(listing: Listing) -> dict[str, str]:
    """``x-tools-listing: brief|names`` when the tools were shortened to fit the context."""
    return {} if listing == "full" else {"x-tools-listing": listing}


def _fitted_prompt(
    engine: Engine,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any],
) -> tuple[tuple[list[int], bool], Listing]:
    """The prompt with the tools listed as fully as the context allows (worker.tools.listing)."""
    if not tools:
        return engine.render_prompt(messages, None, template_kwargs), "full"
    sizes: dict[str, int] = {}

    def render(listing: Listing) -> tuple[list[int], bool]:
        rendered = engine.render_prompt(messages, tools, template_kwargs, listing)
        sizes[listing] = len(rendered[0])
        return rendered

    context = engine.info.context_length
    rendered, listing = tool_listing.fit(render, lambda prompt: len(prompt[0]), context)
    if listing != "full":
        log.info(
            "%d tools listed %s: prompt %d tokens (%d with the full listing), context %d",
            len(tools), listing, sizes[listing], sizes["full"], context,
        )  # fmt: skip
    return rendered, listing


def _output_grammar(chat: ChatCompletionRequest, tools_offered: bool) -> str | None:
    try:
        return output_grammar(chat.response_format, tools_offered)
    except OutputFormatError as exc:
        raise BadRequest(str(exc), exc.param) from exc


async def _grammar_processor(engine: Engine, grammar: str) -> GrammarProcessor:
    try:
        return await agrammar_processor(engine.tokenizer, grammar)
    except OutputFormatError as exc:
        raise BadRequest(str(exc), exc.param) from exc


def _sampling_used(job: Job) -> dict[str, Any]:
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


def _logprob_entries(logprobs: list[tuple[str, float]]) -> list[dict[str, Any]]:
    return [{"token": t, "logprob": lp, "top_logprobs": []} for t, lp in logprobs]


# Like vLLM, the final choice also carries ``stop_reason``: the stop string that ended the
# answer, or null. Plain OpenAI clients ignore it; the gateway maps it to Anthropic's
# ``stop_sequence``.
def _finish_reason(assembler: DeltaAssembler, done: Finished) -> str:
    # A call cut off by max_tokens was already streamed as a call: "length" says it is cut.
    if assembler.tool_calls and done.finish_reason != "length":
        return "tool_calls"
    return done.finish_reason


async def _sse_frames(  # noqa: C901 - to be split (complexity gate, issue 10)
    engine: Engine,
    job: Job,
    assembler: DeltaAssembler,
    meta: dict[str, Any],
    include_usage: bool,
    continuous_usage: bool = False,
) -> AsyncIterator[bytes]:
    base = {**meta, "object": "chat.completion.chunk"}
    first = True
    pending_logprobs: list[tuple[str, float]] = []
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
            choice["logprobs"] = {"content": _logprob_entries(pending_logprobs)}
            pending_logprobs.clear()
        chunk = {**base, "choices": [choice]}
        if done is not None:
            chunk["sampling"] = _sampling_used(job)
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
            engine.commit(job)
        else:
            # Client gone before the end: stop generating now.
            engine.cancel(job)


async def _collect(job: Job, assembler: DeltaAssembler) -> tuple[Finished | Failed, list[Any]]:
    logprobs: list[tuple[str, float]] = []
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


async def _collect_unless_disconnected(
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


def _completion_body(
    meta: dict[str, Any],
    assembler: DeltaAssembler,
    done: Finished,
    logprobs: list[tuple[str, float]] | None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "message": assembler.message(),
        "finish_reason": _finish_reason(assembler, done),
        "stop_reason": done.stop_sequence,
        "logprobs": {"content": _logprob_entries(logprobs)} if logprobs is not None else None,
    }
    return {
        **meta,
        "object": "chat.completion",
        "choices": [choice],
        "usage": _usage(done),
    }


class WorkerSecretGuard:
    """Pure ASGI: a 401 for any request without the worker's secret (none set: open)."""

    def __init__(self, app: ASGIApp, *, secret: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {secret}".encode() if secret else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is not None and scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(
                    401, "this worker serves its node only", type_="authentication_error"
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def serve(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 9339,
    *,
    announce: bool = True,
    secret: str | None = None,
    warm_up: bool = False,
) -> None:
    """Serve ``engine`` until interrupted; prints ``worker listening on URL (model NAME)``,
    with ``warm_up`` only after the warm-up requests (worker/warm_up.py) ran."""
    import uvicorn

    from worker.warm_up import warm_up as run_warm_up

    sock = bind_socket(host, port)
    actual_port = sock.getsockname()[1]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{actual_port}"
    try:
        app = create_app(engine, secret=secret)
        if warm_up:
            asyncio.run(run_warm_up(app, secret=secret))
        # No lifespan handlers: "off" also keeps uvicorn from logging a traceback on Ctrl-C.
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off", **server_limits()
        )
        server = uvicorn.Server(config)
        if announce:
            _announce(engine, url)
        server.run(sockets=[sock])
    finally:
        sock.close()


def _announce(engine: Engine, url: str) -> None:
    print(f"worker listening on {url} (model {engine.name})", flush=True)
    # After the announcement: whoever reads the first line for the URL still finds it there.
    for line in engine.cpu_fast_path.lines() if engine.cpu_fast_path else ():
        print(line, flush=True)
    if engine.stats.warm_up_s is not None:
        tokens, seconds = engine.stats.warm_up_tokens, engine.stats.warm_up_s
        print(f"warm-up: {tokens} tokens in {seconds:.2f}s", flush=True)
    defaults = engine.sampling_defaults
    print(
        f"sampling defaults ({defaults.source}): temperature {defaults.temperature}, "
        f"top_p {defaults.top_p}, top_k {defaults.top_k}, min_p {defaults.min_p}",
        flush=True,
    )
