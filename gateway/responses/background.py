"""Background Responses (``background: true``): the answer runs on after the request returns.

``POST`` answers at once – the ``queued`` response object, or (``stream: true``) a stream that
follows the run – and the run goes on whatever the client does: disconnecting stops nothing.
``GET /v1/responses/{id}`` polls it (the object so far, with the output generated until now), ``GET …?stream=true&starting_after=N``
resumes its event stream after sequence number N, ``POST …/cancel`` stops the generation
(status ``cancelled``). The stored row follows the run (queued → in_progress → final), so a poll
after the end reads the store.

A run lives in this process only: a node restart ends it, and the node then marks the stored
row ``failed`` (the spec does not ask background responses to survive a restart). Finished
runs keep their events for resumption a while (the last ``KEEP_FINISHED``), then only the
stored object remains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway import sse
from gateway.api.errors import openai_error_body
from gateway.config import GatewayConfig
from gateway.events import Done, Error, ErrorKind, Meta
from gateway.exchange import error_response, json_response
from gateway.metrics import GatewayMetrics, RequestRecord
from gateway.refusals import RequestInvalid
from gateway.request import ChatRequest
from gateway.responses import wire
from gateway.responses.state import ResponseStates, stored_turn
from gateway.router import Router

log = logging.getLogger(__name__)

KEEP_FINISHED = 64
TERMINAL_STATUSES = frozenset({"completed", "failed", "incomplete", "cancelled"})


class BackgroundState(Protocol):
    """The slice of the gateway's state background runs read: where they run, are stored and
    counted, and the runs themselves."""

    config: GatewayConfig  # keepalive_s
    router: Router
    metrics: GatewayMetrics
    responses: ResponseStates
    background: BackgroundRuns


class BackgroundRun:
    """One background response: its task, every stream event so far, and its stored row."""

    def __init__(
        self,
        state: BackgroundState,
        request: ChatRequest,
        body: wire.ResponsesBody,
        routes: list,
        record: RequestRecord,
    ) -> None:
        self.state = state
        self.request = request
        self.body = body
        self.routes = routes
        self.record = record
        self.encoder = wire.ResponsesStreamEncoder(request, body, body._response_id)
        self.id = self.encoder.shell.id
        self.status = "queued"
        self.events: list[dict[str, Any]] = []  # events[n]["sequence_number"] == n
        self._changed = asyncio.Event()
        self.finished = False  # every event emitted, the row stored: followers may stop
        self._t0 = time.perf_counter()
        encoder = self.encoder
        self._emit([encoder.status_event("created", "queued"), encoder.status_event("queued")])
        self._store(self.snapshot())
        self.task = asyncio.create_task(self._run(), name=f"background-{self.id}")

    @property
    def done(self) -> bool:
        return self.status in TERMINAL_STATUSES

    def snapshot(self) -> dict[str, Any]:
        """The response object as it stands (the final one once done)."""
        if self.encoder.final is not None:
            return self.encoder.final
        return self.encoder.shell.response(self.status, self.encoder.output_so_far())

    def _emit(self, events: list[dict[str, Any]]) -> None:
        if events:
            self.events += events
            self._changed.set()
            self._changed = asyncio.Event()

    def _store(self, response: dict[str, Any]) -> None:
        self.state.responses.put(stored_turn(self.body, response))

    async def _run(self) -> None:
        try:
            await self._generate()
        except asyncio.CancelledError:
            self._finish_cancelled()
        except Exception as exc:  # a bug: the run must still end, stored as failed
            log.exception("background response %s failed", self.id)
            self._emit(self.encoder.events(Error(kind="internal", message=type(exc).__name__)))
        finally:
            if self.encoder.final is not None:
                self.status = self.encoder.final["status"]
                self._store(self.encoder.final)
            self.finished = True
            self._changed.set()
            self._finish_record()

    async def _generate(self) -> None:
        router = self.state.router
        self.status = "in_progress"
        self._emit([self.encoder.status_event("in_progress")])
        self._store(self.snapshot())
        # Streamed from the upstream whatever the client asked: the router holds a
        # non-streamed answer back until it ends, and a poll must see the output so far.
        request = self.request.model_copy(update={"stream": True})
        async with contextlib.aclosing(router.stream(request, self.routes)) as events:
            async for event in events:
                if isinstance(event, Meta):
                    self.record.route.update(event.headers)
                    self.encoder.acc.add(event)  # x-moa-* facts reach the response's metadata
                    continue
                if self.record.ttft_s is None and not isinstance(event, Done | Error):
                    self.record.ttft_s = time.perf_counter() - self._t0
                self._emit(self.encoder.events(event))
                if isinstance(event, Done | Error):
                    return

    def _finish_cancelled(self) -> None:
        self.status = "cancelled"
        final = self.encoder.shell.response(
            "cancelled", list(self.encoder.output), self.encoder.acc
        )
        self.encoder.final = final
        error = {
            "type": "invalid_request_error",
            "code": "response_cancelled",
            "message": f"response {self.id} was cancelled",
            "param": None,
        }
        self._emit([self.encoder._event("error", error=error)])

    def _finish_record(self) -> None:
        record, acc = self.record, self.encoder.acc
        record.duration_s = time.perf_counter() - self._t0
        record.count_tokens(acc)
        record.outcome = acc.error.kind if acc.error is not None else self.status
        self.state.metrics.observe(record)

    def cancel(self) -> None:
        if not self.task.done():
            self.task.cancel()

    async def follow(self, after: int, keepalive_s: float) -> AsyncIterator[bytes]:
        """SSE frames of the events after sequence number ``after``, live until the end."""
        index = after + 1
        while True:
            changed = self._changed
            while index < len(self.events):
                event = self.events[index]
                yield sse.named_frame(event["type"], event)
                index += 1
            if self.finished:
                return
            try:
                await asyncio.wait_for(changed.wait(), keepalive_s)
            except TimeoutError:
                yield sse.KEEPALIVE


class BackgroundRuns:
    """The node's background runs: live ones, and the last finished ones for resumption."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.runs: OrderedDict[str, BackgroundRun] = OrderedDict()

    @property
    def live(self) -> int:
        return sum(1 for run in self.runs.values() if not run.task.done())

    def start(self, run_args: tuple) -> BackgroundRun:
        if self.live >= self.limit:
            raise RequestInvalid(f"too many background responses running (limit {self.limit})")
        run = BackgroundRun(*run_args)
        self.runs[run.id] = run
        finished = [rid for rid, r in self.runs.items() if r.task.done()]
        for rid in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            del self.runs[rid]
        return run

    def get(self, response_id: str) -> BackgroundRun | None:
        return self.runs.get(response_id)

    def forget(self, response_id: str) -> None:
        self.runs.pop(response_id, None)

    async def aclose(self) -> None:
        for run in self.runs.values():
            run.cancel()
        await asyncio.gather(*(run.task for run in self.runs.values()), return_exceptions=True)


def start(
    state: BackgroundState, request: ChatRequest, body: Any, routes: list, record: RequestRecord
) -> Response | None:
    """Take over a ``background: true`` request (ApiSpec.detach); None for a normal one."""
    if not getattr(body, "background", False):
        return None
    if body.store is False:
        error = RequestInvalid(
            "background: a background response must be stored (store: true)", "background"
        )
        return error_response(openai_error_body, error.to_error())
    try:
        run = state.background.start((state, request, body, routes, record))
    except RequestInvalid as exc:
        return error_response(openai_error_body, Error(kind="overloaded", message=exc.message))
    if request.stream:
        return _follow_response(state, run, -1)
    return json_response(run.snapshot())


def _follow_response(state: BackgroundState, run: BackgroundRun, after: int) -> Response:
    return StreamingResponse(
        run.follow(after, state.config.keepalive_s), headers=dict(sse.SSE_HEADERS)
    )


def retrieve(request: Request) -> Response | None:
    """``GET /v1/responses/{id}`` of a run this node holds (None: read the store)."""
    state: BackgroundState = request.app.state.gateway
    run = state.background.get(request.path_params["response_id"])
    stream = request.query_params.get("stream", "false").lower() == "true"
    if run is None:
        if stream:
            message = "stream: this response has no resumable stream here (not a recent background response)"
            return error_response(
                openai_error_body,
                Error(kind="invalid_request", message=message, details={"param": "stream"}),
            )
        return None
    if not stream:
        return json_response(run.snapshot())
    raw_after = request.query_params.get("starting_after", "-1")
    try:
        after = int(raw_after)
    except ValueError:
        after = -2
    if after < -1:
        error = Error(
            kind="invalid_request",
            message="starting_after: must be a sequence number (an integer ≥ 0)",
            details={"param": "starting_after"},
        )
        return error_response(openai_error_body, error)
    return _follow_response(state, run, after)


async def cancel(request: Request) -> Response:
    """``POST /v1/responses/{id}/cancel``: stop a background response; its object after."""
    state: BackgroundState = request.app.state.gateway
    response_id = request.path_params["response_id"]
    run = state.background.get(response_id)
    if run is None:
        stored = await state.responses.get(response_id)
        message = (
            f"Response {response_id} was not created in background mode or has finished long ago"
            if stored is not None
            else f"Response with id '{response_id}' not found."
        )
        kind: ErrorKind = "invalid_request" if stored is not None else "not_found"
        return error_response(openai_error_body, Error(kind=kind, message=message))
    run.cancel()
    await asyncio.wait([run.task])  # never raises, and never cancels the run a second time
    return json_response(run.snapshot())
