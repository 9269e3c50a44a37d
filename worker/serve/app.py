"""The worker's HTTP app: OpenAI chat completions (stream and not), /v1/models, /health,
/metrics (worker/serve/metrics.py).

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
from typing import Any

import orjson
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from worker.chat.job import BadRequest, listing_header, start_job
from worker.chat.next_turn import commit_answer
from worker.chat.prompt import ChatTemplate
from worker.chat.prompt_blocks import prompt_blocks, prompt_cache_held
from worker.chat.schemas import ChatCompletionRequest, describe_validation_error
from worker.chat.wire import (
    collect_unless_disconnected,
    completion_body,
    sampling_used,
    sse_frames,
)
from worker.convert.tokenizer import is_fallback_template
from worker.engine.budget import BudgetRefusal
from worker.engine.core import Engine
from worker.engine.types import Failed
from worker.serve.metrics import make_registry, metrics
from worker.serve.net import bind_socket, server_limits

log = logging.getLogger(__name__)


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


async def chat_completions(request: Request) -> Response:
    engine: Engine = request.app.state.engine
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
        job, assembler, listing, turn = await start_job(
            engine, request.app.state.template, chat, body
        )
    except BadRequest as exc:
        return error_response(
            400, str(exc), type_="invalid_request_error", param=exc.param, code=exc.code
        )
    except BudgetRefusal as exc:  # the memory budget: 429 for now, 413 for ever
        response = error_response(
            exc.status,
            str(exc),
            type_="rate_limit_error" if exc.status == 429 else "invalid_request_error",
            code="memory_budget",
        )
        if exc.retry_after_s is not None:
            response.headers["retry-after"] = str(exc.retry_after_s)
        return response
    meta = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "created": int(time.time()),
        "model": engine.name,
    }
    if chat.stream:
        options = chat.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(include_usage and options and options.continuous_usage_stats)
        frames = sse_frames(engine, job, assembler, meta, include_usage, continuous, turn)
        return StreamingResponse(
            frames,
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"}
            | listing_header(listing),
        )
    collected = await collect_unless_disconnected(request, engine, job, assembler)
    if collected is None:
        return Response(status_code=499)
    result, logprobs = collected
    if isinstance(result, Failed):
        return error_response(500, result.message, type_="server_error")
    body = completion_body(meta, assembler, result, logprobs if chat.logprobs else None)
    body["sampling"] = sampling_used(job)
    # The commit runs as a background task: after the body went out.
    commit = BackgroundTask(commit_answer, engine, job, turn, assembler.message())
    response = json_response(body, background=commit)
    response.headers.update(listing_header(listing))
    return response


async def models(request: Request) -> Response:
    engine: Engine = request.app.state.engine
    template: ChatTemplate = request.app.state.template
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
            "tools": template.tool_calling,  # native, or the generic tool prompt
            "thinking": bool(engine.tokenizer.has_thinking),
            # Without one (a base model) it continues the text instead of answering the turn.
            # The converter's stand-in for a GGUF without one counts as none.
            "chat_template": bool(engine.tokenizer.has_chat_template)
            and not is_fallback_template(getattr(engine.tokenizer, "chat_template", None)),
            "context_length": info.context_length,
        },
    }
    return json_response({"object": "list", "data": [entry | _how_it_runs(engine)]})


async def health(request: Request) -> Response:
    engine: Engine = request.app.state.engine
    stats = engine.stats
    return json_response(
        {
            "status": "ok",
            "model": engine.name,
            "queue_depth": stats.queue_depth,
            "in_flight": stats.in_flight,
            "tokens_per_second": round(engine.tokens_per_second(), 3),
            "prefill_tokens_per_second": _rounded(engine.prefill_tokens_per_second()),
            "uptime_s": round(engine.uptime_s, 3),
            "warm_up_s": _rounded(stats.warm_up_s),
            "cache_digest": engine.cache_digest.to_wire(),  # routing by prefix (mesh)
            # The prompt cache's disk tier (entries, bytes, bound, writes, loads; null: none).
            # The memory tier (entries, bytes, bound, distinct prefixes in both tiers, hits).
            "prompt_cache": engine.prompt_cache,
            "prompt_cache_disk": engine.prompt_cache_disk,
            # The memory budget: its limit and what running KV and the cache use (null: none).
            "memory": engine.memory_budget,
            "loops_stopped": stats.loops_stopped,
            # In one step this long (0: waiting for work): the node's health check reads it.
            "engine_busy_s": round(engine.busy_s, 3),
            # Speculative decoding (worker/speculative/batch.py): drafted and accepted tokens,
            # and tokens a verify pass gives each row (1 would be plain decoding).
            # "draft": where drafts come from ("prompt lookup" or the draft model's path).
            "speculation": {"mode": engine.config.speculation.mode, "draft": engine.draft_source}
            | engine.speculation.as_dict(),
            # Prefill work since start (the warm-up's included): samples of one prompt
            # show up as one prefill and shared ones (worker/engine/shared_prefill.py).
            "prefill": {
                "prefills": stats.prefills,
                "prompt_tokens_computed": stats.prompt_tokens_computed,
                "shared": stats.shared_prefills,
                "shared_tokens": stats.shared_prefill_tokens,
            },
        }
        | _how_it_runs(engine)
    )


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/v1/prompt_blocks", prompt_blocks, methods=["POST"]),  # routing by prefix (mesh)
    Route("/v1/prompt_cache/held", prompt_cache_held, methods=["POST"]),  # routing by prefix
    Route("/metrics", metrics, methods=["GET"]),  # the budget and the prompt cache's tiers
]


def create_app(engine: Engine, *, secret: str | None = None) -> Starlette:
    """The worker app over a started engine (the caller starts and closes the engine); its
    routes read the engine and its model's chat template from ``app.state``.

    With a ``secret`` every route wants ``Authorization: Bearer <secret>``: the node gives each
    worker it starts a random one, so no other local process can use the worker's port to get
    past the gateway's API key."""
    app = Starlette(routes=ROUTES, middleware=[Middleware(WorkerSecretGuard, secret=secret)])
    app.state.engine = engine
    app.state.template = ChatTemplate(engine.tokenizer)
    app.state.metrics = make_registry(engine.name, engine)
    return app


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _how_it_runs(engine: Engine) -> dict[str, Any]:
    """``cpu_fast_path`` (BLAS, GFLOP/s, dequantized) on the CPU backend; nothing elsewhere."""
    if engine.cpu_fast_path is None:
        return {}
    return {"cpu_fast_path": engine.cpu_fast_path.as_dict()}


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
    with ``warm_up`` only after the warm-up requests (worker/serve/warm_up.py) ran."""
    import uvicorn

    from worker.serve.warm_up import warm_up as run_warm_up

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
