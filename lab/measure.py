"""One measured request: send it with httpx, read the body at the byte level, return a row.

The deadline is hard: ``asyncio.timeout`` around the whole exchange. Before the response head
it is a ``timeout``; after the head, a body that has not ended (terminal event *and* EOF) is
``hung`` – the number that must stay 0.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import orjson

from lab.rows import ApiName, Outcome, ProbeKind, ProbeRow
from lab.sse import SSEDecoder
from lab.wire import (
    PATHS,
    build_body,
    build_headers,
    error_message,
    make_reader,
    parse_nonstream,
    sentinel_passed,
)


@dataclass(frozen=True, slots=True)
class Target:
    """One gateway under test. ``name`` is the row's ``target`` ("a", or "b" in A/B mode)."""

    name: str
    url: str


@dataclass(slots=True)
class _Exchange:
    """Mutable facts gathered while the request runs (so a timeout keeps what was seen)."""

    head_seen: bool = False
    status: int | None = None
    route: str | None = None
    peer: str | None = None
    moa_winner: str | None = None
    retry_after: str | None = None
    first_content: float | None = None
    last_content: float | None = None

    def take_headers(self, response: httpx.Response) -> None:
        self.head_seen, self.status = True, response.status_code
        self.route = response.headers.get("x-route")
        self.peer = response.headers.get("x-peer")
        self.moa_winner = response.headers.get("x-moa-winner")
        self.retry_after = response.headers.get("retry-after")


def _row(
    target: Target, kind: ProbeKind, model: str, api: ApiName | None, t: float, **fields
) -> ProbeRow:
    return ProbeRow(
        t=t, target=target.name, url=target.url, kind=kind, model=model, api=api, **fields
    )


def _http_error(status: int, body: bytes) -> str:
    try:
        return f"HTTP {status}: {error_message(orjson.loads(body))}"
    except orjson.JSONDecodeError:
        return f"HTTP {status}: {body[:200].decode('utf-8', 'replace')!r}"


async def list_models(
    client: httpx.AsyncClient, target: Target, *, timeout_s: float, api_key: str | None = None
) -> tuple[ProbeRow, list[str]]:
    """``GET /v1/models``: the row and the model ids (empty on failure)."""
    t, start = time.time(), time.perf_counter()
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    ex = _Exchange()
    try:
        async with asyncio.timeout(timeout_s):
            response = await client.get(f"{target.url}/v1/models", headers=headers)
            ex.take_headers(response)
    except TimeoutError:
        return _row(
            target,
            "models",
            "*",
            None,
            t,
            outcome=Outcome.TIMEOUT,
            duration_s=timeout_s,
            error="no answer",
        ), []
    except httpx.HTTPError as exc:
        return _row(
            target,
            "models",
            "*",
            None,
            t,
            outcome=Outcome.TRANSPORT_ERROR,
            duration_s=time.perf_counter() - start,
            error=f"{type(exc).__name__}: {exc}",
        ), []
    elapsed = time.perf_counter() - start
    if response.status_code >= 400:
        return _row(
            target,
            "models",
            "*",
            None,
            t,
            outcome=Outcome.HTTP_ERROR,
            status=response.status_code,
            retry_after=ex.retry_after,
            duration_s=elapsed,
            error=_http_error(response.status_code, response.content),
        ), []
    try:
        ids = [str(item["id"]) for item in orjson.loads(response.content)["data"]]
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        return _row(
            target,
            "models",
            "*",
            None,
            t,
            outcome=Outcome.TRANSPORT_ERROR,
            status=response.status_code,
            duration_s=elapsed,
            error=f"bad /v1/models body: {exc!r}",
        ), []
    row = _row(
        target,
        "models",
        "*",
        None,
        t,
        outcome=Outcome.OK,
        status=response.status_code,
        duration_s=elapsed,
        ttft_s=elapsed,
        text=",".join(ids),
    )
    return row, ids


async def measure_request(  # noqa: C901 - to be split (complexity gate, issue 10)
    client: httpx.AsyncClient,
    target: Target,
    *,
    api: ApiName,
    model: str,
    prompt: str,
    stream: bool,
    max_tokens: int,
    timeout_s: float,
    api_key: str | None = None,
    sentinel_word: str | None = None,
) -> ProbeRow:
    """One request through ``api``; a stream is timed at the first content byte (TTFT)."""
    kind: ProbeKind = "stream" if stream else "sentinel"
    body = orjson.dumps(build_body(api, model, prompt, stream=stream, max_tokens=max_tokens))
    t, start = time.time(), time.perf_counter()
    ex = _Exchange()
    reader = make_reader(api)
    decoder = SSEDecoder()
    raw = bytearray()

    def finish(
        outcome: Outcome,
        error: str | None = None,
        text: str | None = None,
        tokens: int | None = None,
    ) -> ProbeRow:
        tok_s = None
        if (
            stream
            and tokens
            and tokens > 1
            and ex.first_content is not None
            and ex.last_content is not None
            and ex.last_content > ex.first_content
        ):
            tok_s = (tokens - 1) / (ex.last_content - ex.first_content)
        ttft = (ex.first_content - start) if ex.first_content is not None else None
        sentinel_ok = None
        if sentinel_word is not None and outcome is Outcome.OK:
            sentinel_ok = sentinel_passed(text or "", sentinel_word)
        return _row(
            target,
            kind,
            model,
            api,
            t,
            outcome=outcome,
            status=ex.status,
            error=error,
            route=decoder.route_facts.get("x-route", ex.route),
            peer=decoder.route_facts.get("x-peer", ex.peer),
            moa_winner=ex.moa_winner,
            retry_after=ex.retry_after,
            ttft_s=ttft,
            duration_s=time.perf_counter() - start,
            tokens=tokens,
            tok_s=tok_s,
            text=text,
            sentinel_ok=sentinel_ok,
        )

    try:
        async with asyncio.timeout(timeout_s):
            request = client.build_request(
                "POST",
                f"{target.url}{PATHS[api]}",
                content=body,
                headers=build_headers(api, api_key),
            )
            response = await client.send(request, stream=True)
            try:
                ex.take_headers(response)
                async for chunk in response.aiter_bytes():
                    now = time.perf_counter()
                    if not stream or response.status_code >= 400:
                        raw += chunk
                        continue
                    for frame in decoder.feed(chunk):
                        if reader.feed(frame.event, frame.data):
                            ex.first_content = ex.first_content or now
                            ex.last_content = now
            finally:
                await response.aclose()
    except TimeoutError:
        if not ex.head_seen:
            return finish(Outcome.TIMEOUT, f"no response head within {timeout_s:g}s")
        state = reader.state
        why = (
            "terminal event sent but the body never closed"
            if state.terminal
            else "stream never terminated"
        )
        return finish(
            Outcome.HUNG, f"{why} within {timeout_s:g}s", state.text or None, state.tokens or None
        )
    except httpx.HTTPError as exc:
        outcome = Outcome.TRUNCATED if ex.head_seen else Outcome.TRANSPORT_ERROR
        return finish(outcome, f"{type(exc).__name__}: {exc}", reader.state.text or None)

    status = ex.status or 0
    if status >= 400:
        return finish(Outcome.HTTP_ERROR, _http_error(status, bytes(raw)))
    if not stream:
        try:
            payload = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return finish(Outcome.TRUNCATED, f"non-JSON body: {bytes(raw[:120])!r}")
        if not isinstance(payload, dict):
            return finish(Outcome.TRANSPORT_ERROR, f"body is not an object: {bytes(raw[:120])!r}")
        if payload.get("error") or payload.get("status") == "failed":
            # A 200 body that reports failure (Responses carries "error": null when fine).
            return finish(Outcome.ERROR_EVENT, error_message(payload))
        ex.first_content = time.perf_counter()
        text, tokens = parse_nonstream(api, payload)
        return finish(Outcome.OK, text=text, tokens=tokens)
    state = reader.state
    if state.terminal == "ok":
        return finish(Outcome.OK, text=state.text, tokens=state.tokens)
    if state.terminal == "error":
        return finish(Outcome.ERROR_EVENT, state.error, state.text or None, state.tokens or None)
    content_type = response.headers.get("content-type", "")
    return finish(
        Outcome.TRUNCATED,
        f"body ended without a terminal event (content-type {content_type!r})",
        state.text or None,
        state.tokens or None,
    )
