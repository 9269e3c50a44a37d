"""Test doubles shared by every test of the gateway, MoA and mesh (like httpx's MockTransport).

- :class:`ScriptedUpstream` plays a script of events with delays, can raise or stall at given
  points, records the requests it received and whether it was cancelled.
- :class:`RankedDirectory` is a :class:`~gateway.upstream.StaticDirectory` whose ``aroutes``
  (the mesh's cache-aware ranking) answers from a script and records what it was asked.
- :func:`asgi_request` drives an ASGI app in-process and can disconnect at a chosen moment.
- :func:`chat_request` parses a Chat Completions body the way the gateway does (thinking knobs
  normalised at the edge), for tests that need a ``ChatRequest`` as a client would make it.
- :class:`ServerThread` runs an app on uvicorn on 127.0.0.1, port 0, in a background thread;
  :func:`gateway_over_worker` runs a real worker (one model) behind a real gateway that way.
- :func:`chat_stream_chunks` reads the JSON chunks of a Chat Completions stream (benches).
- :class:`ToolRoundTrip` answers a real agent harness (Claude Code, OpenCode) by looking at
  each request: a call of the harness's tool, then a final answer, and side answers for the
  rest; :class:`HttpRecorder` keeps every HTTP exchange the harness had with the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.answer import new_id
from gateway.events import Done, Event, ReasoningDelta, TextDelta, ToolCallDelta, Usage
from gateway.request import ChatRequest
from gateway.upstream import Route, StaticDirectory, Upstream


def chat_request(model: str = "mesh", content: str = "hi", **fields: Any) -> ChatRequest:
    """A ``ChatRequest`` parsed from a Chat Completions body with ``fields`` (any API knob)."""
    from gateway.api import chat

    body = {"model": model, "messages": [{"role": "user", "content": content}], **fields}
    return chat.parse(body)[0]


@dataclass(frozen=True)
class Sleep:
    """Wait this long before the next script step."""

    seconds: float


@dataclass(frozen=True)
class Raise:
    """Raise this exception from the upstream at this point."""

    exc: BaseException


@dataclass(frozen=True)
class Stall:
    """Never continue (until cancelled): a hung peer or a very long prefill."""


Step = Event | Sleep | Raise | Stall


@dataclass
class ScriptedUpstream(Upstream):
    """An :class:`~gateway.upstream.Upstream` that plays scripted steps.

    ``scripts`` holds one script per call (the last one repeats), so a retry test can fail the
    first call and succeed on the second. ``delay_s`` is slept before every event.
    """

    scripts: list[list[Step]]
    name: str = "scripted"
    delay_s: float = 0.0
    retryable: bool = True  # False plays the MoA, which the router never retries
    requests: list[ChatRequest] = field(default_factory=list)
    cancelled: int = 0
    completed: int = 0
    active: int = 0
    started: asyncio.Event = field(default_factory=asyncio.Event)  # set on the first call

    @classmethod
    def of(cls, *steps: Step, name: str = "scripted", delay_s: float = 0.0) -> ScriptedUpstream:
        return cls(scripts=[list(steps)], name=name, delay_s=delay_s)

    @property
    def calls(self) -> int:
        return len(self.requests)

    async def stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        script = self.scripts[min(len(self.requests), len(self.scripts) - 1)]
        self.requests.append(request)
        self.active += 1
        self.started.set()
        try:
            for step in script:
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                elif isinstance(step, Raise):
                    raise step.exc
                elif isinstance(step, Stall):
                    await asyncio.Event().wait()
                else:
                    yield step
            self.completed += 1
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled += 1
            raise
        finally:
            self.active -= 1


@dataclass
class SeededUpstream(Upstream):
    """A model whose reply is a pure function of the request (``reply``; deltas split at "|"),
    streamed the way one batch decodes, with random pauses drawn from ``rng``: each call's first
    delta within ``first_s``, each later delta and its end ``step_s`` to 2 ``step_s`` after the
    one before (so, with ``first_s`` < ``step_s``, no call ends before every call streams). For
    checking that an answer depends on what was asked, not on how streams interleave."""

    reply: Callable[[ChatRequest], str]
    rng: random.Random = field(default_factory=random.Random)
    first_s: float = 0.003
    step_s: float = 0.005
    name: str = "seeded"
    requests: list[ChatRequest] = field(default_factory=list)

    async def stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        self.requests.append(request)
        await asyncio.sleep(self.rng.uniform(0.0, self.first_s))
        for i, piece in enumerate(self.reply(request).split("|")):
            if i:
                await asyncio.sleep(self.rng.uniform(self.step_s, 2 * self.step_s))
            yield TextDelta(piece, logprob=-0.1)
        await asyncio.sleep(self.rng.uniform(self.step_s, 2 * self.step_s))
        yield Done()


@dataclass
class RankedDirectory(StaticDirectory):
    """A directory that ranks routes by the request, as the mesh's does (``aroutes``):
    ``ranked[model]`` is the answer for that model (best first; none or [] leaves it to
    ``routes``, as the mesh does with one node), ``asked`` every request it ranked."""

    ranked: dict[str, list[Route]] = field(default_factory=dict)
    asked: list[ChatRequest] = field(default_factory=list)

    async def aroutes(self, request: ChatRequest) -> list[Route]:
        self.asked.append(request)
        return list(self.ranked.get(request.model, []))


def text_script(
    text: str = "Hello, world!",
    *,
    chunk: int = 3,
    reasoning: str = "",
    tool_calls: Sequence[tuple[str, str]] = (),
    finish: str | None = None,
    usage: Usage | None = Usage(prompt_tokens=7, completion_tokens=5, cached_tokens=2),
) -> list[Step]:
    """A typical answer: reasoning deltas, text deltas, tool calls (name, JSON args), usage, done."""
    steps: list[Step] = []
    steps += [ReasoningDelta(reasoning[i : i + chunk]) for i in range(0, len(reasoning), chunk)]
    steps += [TextDelta(text[i : i + chunk]) for i in range(0, len(text), chunk)]
    for index, (name, args) in enumerate(tool_calls):
        steps.append(ToolCallDelta(index=index, id=f"call_{index}", name=name, arguments=""))
        steps += [
            ToolCallDelta(index=index, arguments=args[i : i + chunk])
            for i in range(0, len(args), chunk)
        ]
    if usage is not None:
        steps.append(usage)
    steps.append(Done(finish or ("tool_calls" if tool_calls else "stop")))  # type: ignore[arg-type]
    return steps


@dataclass
class ToolRoundTrip(Upstream):
    """A scripted model for real agent harnesses, which send requests in their own order (side
    requests such as a title come first or in between): each answer is chosen by looking at
    the request, not by counting calls.

    - ``tool`` offered and no tool result since the last assistant turn: a call of ``tool``
      with ``arguments`` (a fresh id each time: a harness takes a repeated id for a call it
      already ran), after ``reasoning`` when set;
    - a tool result since the last assistant turn (system reminders may follow it): ``answer``;
    - anything else (no such tool: a title, a summary): ``side_answer``.
    """

    tool: str
    arguments: dict[str, Any]
    answer: str
    side_answer: str = "Side answer."
    reasoning: str = ""
    name: str = "scripted"
    retryable: bool = True
    requests: list[ChatRequest] = field(default_factory=list)

    async def stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        self.requests.append(request)
        for step in self.script_for(request):
            if isinstance(step, ToolCallDelta) and step.id is not None:
                step = ToolCallDelta(step.index, new_id("call_"), step.name, step.arguments)
            yield step  # type: ignore[misc]  # text_script makes events only

    def script_for(self, request: ChatRequest) -> list[Step]:
        since_assistant: list[str] = []
        for message in reversed(request.messages):
            if message.role == "assistant":
                break
            since_assistant.append(message.role)
        if "tool" in since_assistant:
            return text_script(self.answer, reasoning=self.reasoning)
        if any(tool.name == self.tool for tool in request.tools):
            args = orjson.dumps(self.arguments).decode()
            return text_script("", reasoning=self.reasoning, tool_calls=[(self.tool, args)])
        return text_script(self.side_answer)

    def tool_results(self) -> dict[str, str]:
        """Every tool result the harness sent back: call id → content, first seen first."""
        results: dict[str, str] = {}
        for request in self.requests:
            for message in request.messages:
                if message.role == "tool" and message.tool_call_id is not None:
                    results.setdefault(message.tool_call_id, message.content)
        return results


@dataclass
class HttpExchange:
    """One request a client made and the status it got."""

    method: str
    path: str
    status: int
    headers: dict[str, str]
    body: Any  # the JSON body, or None (no body, or not JSON)


@dataclass
class HttpRecorder:
    """A pure ASGI wrapper that keeps every HTTP exchange with ``app`` (any path, any status:
    the gateway's request log has only the generating APIs' rows)."""

    app: Callable
    exchanges: list[HttpExchange] = field(default_factory=list)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        status = 0

        async def recording_receive() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        async def recording_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, recording_receive, recording_send)
        finally:
            try:
                body = orjson.loads(b"".join(chunks)) if any(chunks) else None
            except orjson.JSONDecodeError:
                body = None
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            exchange = HttpExchange(scope["method"], scope["path"], status, headers, body)
            self.exchanges.append(exchange)

    def bodies(self, path: str) -> list[Any]:
        """The JSON bodies sent to ``path``, in order."""
        return [e.body for e in self.exchanges if e.path == path]


def paced_script(text: str, ttft: float = 0.0) -> list[Step]:
    """An answer a word at a time, 5 ms apart, after ``ttft`` seconds (MoA races)."""
    steps: list[Step] = [Sleep(ttft)] if ttft else []
    for word in text.split(" "):
        steps += [TextDelta(word + " "), Sleep(0.005)]
    return [*steps, Usage(prompt_tokens=3, completion_tokens=5), Done()]


@dataclass
class AsgiResult:
    status: int
    headers: dict[str, str]
    chunks: list[bytes]

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def json(self) -> Any:
        return orjson.loads(self.body)


async def asgi_request(
    app: Callable,
    method: str,
    path: str,
    body: Any = None,
    *,
    headers: Iterable[tuple[str, str]] = (),
    disconnect_after_chunks: int | None = None,
    disconnect_after_s: float | None = None,
) -> AsgiResult:
    """Call ``app`` in-process; optionally disconnect after N body chunks or S seconds."""
    raw = body if isinstance(body, bytes) else (b"" if body is None else orjson.dumps(body))
    hdrs = [(k.lower().encode(), v.encode()) for k, v in headers]
    hdrs.append((b"content-length", str(len(raw)).encode()))
    if body is not None and not isinstance(body, bytes):
        hdrs.append((b"content-type", b"application/json"))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": hdrs,
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 80),
    }
    result = AsgiResult(status=0, headers={}, chunks=[])
    disconnect = asyncio.Event()
    request_sent = False

    async def receive() -> dict:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            result.status = message["status"]
            result.headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            if message.get("body"):
                result.chunks.append(message["body"])
            if (
                disconnect_after_chunks is not None
                and len(result.chunks) >= disconnect_after_chunks
            ):
                disconnect.set()
            if not message.get("more_body", False):
                disconnect.set()

    timer = None
    if disconnect_after_s is not None:
        timer = asyncio.get_running_loop().call_later(disconnect_after_s, disconnect.set)
    try:
        await app(scope, receive, send)
    finally:
        if timer is not None:
            timer.cancel()
    return result


class ServerThread:
    """Serve an ASGI app with uvicorn on 127.0.0.1:<free port> in a daemon thread.

    Use as a context manager; ``url`` is the base URL. ``loop`` is the server's event loop (to
    inspect its tasks from a test with ``asyncio.run_coroutine_threadsafe``).
    """

    def __init__(self, app: Callable, host: str = "127.0.0.1") -> None:
        import uvicorn

        # TCP_NODELAY-capable sockets and the same read deadlines as the real servers.
        from worker.serve.net import bind_socket, server_limits

        self._sock = bind_socket(host, 0)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2, **server_limits()
        )
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="gateway-test-server")

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.serve(sockets=[self._sock]))
        finally:
            self.loop.close()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        for _ in range(500):
            if self.server.started:
                return self
            if not self._thread.is_alive():
                break
            threading.Event().wait(0.01)
        raise RuntimeError("test server did not start")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
        with contextlib.suppress(OSError):
            self._sock.close()

    def run(self, coro: Any, timeout: float = 10) -> Any:
        """Run a coroutine on the server's loop and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextlib.contextmanager
def gateway_over_worker(
    model_dir: Any,
    name: str,
    *,
    config: Any = None,
    make_moa: Callable[[Any], Any] | None = None,
    engine_config: Any = None,
    start_timeout_s: float | None = None,
) -> Iterator[ServerThread]:
    """A real worker (an engine on ``model_dir`` served as ``name``, ``engine_config`` its
    ``EngineConfig``) behind a real gateway (one ``WorkerClient`` in a static directory;
    ``config`` a ``GatewayConfig``, ``make_moa`` builds its MoA from the directory), both on
    loopback threads. Yields the gateway's :class:`ServerThread`, with ``worker_url`` and
    ``engine`` set for tests and benches that look behind it; stops both and closes the engine
    on exit."""
    from gateway.app import create_app
    from gateway.config import GatewayConfig
    from gateway.upstream import ModelInfo, StaticDirectory
    from gateway.worker_client import WorkerClient
    from worker.engine.core import Engine
    from worker.serve.app import create_app as create_worker_app

    engine = Engine(str(model_dir), name=name, config=engine_config)
    engine.start(timeout=start_timeout_s)
    try:
        with ServerThread(create_worker_app(engine)) as worker:
            directory = StaticDirectory()
            directory.add(ModelInfo(id=name), WorkerClient(worker.url, name))
            moa = make_moa(directory) if make_moa is not None else None
            app = create_app(directory, config or GatewayConfig(), moa=moa)
            with ServerThread(app) as front:
                front.worker_url = worker.url  # type: ignore[attr-defined]
                front.engine = engine  # type: ignore[attr-defined]
                yield front
    finally:
        engine.close()


def chat_stream_chunks(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON chunks of a Chat Completions stream, from its lines (httpx's
    ``response.iter_lines()``), as they arrive: ``data: {…}`` parsed; ``[DONE]``, blank lines
    and comments skipped."""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield orjson.loads(line[6:])
