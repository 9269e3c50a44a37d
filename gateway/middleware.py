"""Pure ASGI middleware: Host and Origin checks, API key, body size limit and in-flight limit,
answered in the error shape of the API the client called (Anthropic for /v1/messages, OpenAI
otherwise); and the last line behind them, which turns a bug's exception into a 500 in that shape."""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Collection
from typing import Protocol
from urllib.parse import urlsplit

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.api.errors import anthropic_error_body, openai_error_body
from gateway.config import GatewayConfig, is_ip_literal
from gateway.events import Error

log = logging.getLogger(__name__)

# The console page and its static files hold no data; they ask for the key themselves.
_OPEN_PATHS = frozenset({"/health", "/"})
_OPEN_PREFIXES = ("/static/",)
_GENERATING = frozenset({"/v1/chat/completions", "/v1/responses", "/v1/messages"})


async def _send_error(
    scope: Scope, send: Send, error: Error, headers: dict[str, str] | None = None
) -> None:
    shape = anthropic_error_body if scope["path"].startswith("/v1/messages") else openai_error_body
    body = orjson.dumps(shape(error))
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    # A WebSocket upgrade is refused before it is accepted: with an HTTP answer where the server
    # can send one (the websocket.http.response extension), else a close (HTTP 403).
    prefix = "http"
    if scope["type"] == "websocket":
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close", "code": 1008, "reason": error.message[:120]})
            return
        prefix = "websocket.http"
    start = {"type": f"{prefix}.response.start", "status": error.status, "headers": raw_headers}
    await send(start)
    await send({"type": f"{prefix}.response.body", "body": body})


class ServerErrorGuard:
    """Any exception escaping the app becomes a 500 in the API's error shape, logged with its
    traceback. It is meant for bugs: client mistakes are 4xx before they get here.

    The exception stops here: re-raised, the server would drop the kept-alive connection (uvicorn
    closes it when the app raises) along with the client's next request on it. Only a response
    already under way is re-raised: it is cut short, so its connection has to go.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = finished = False

        async def watched(message: Message) -> None:
            nonlocal started, finished
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if finished:
                return  # the client has its whole answer; the connection is fine
            if started:
                raise
            error = Error(kind="internal", message=f"internal server error ({type(exc).__name__})")
            await _send_error(scope, send, error)


class HostGuard:
    """Refuses what a browser can be tricked into sending to a gateway on this machine.

    - DNS rebinding: a page of the attacker's, its name re-pointed at 127.0.0.1, calls the
      gateway as a same-origin site. Its requests carry the attacker's name in ``Host``: a name
      that is not an IP literal nor in ``allowed_hosts`` gets 421.
    - Cross-site requests: any page may POST to ``http://127.0.0.1:9337`` (a text/plain body
      needs no CORS preflight). A state-changing request whose ``Origin`` is not this gateway's
      own (the console), an allowed name or a loopback address gets 403.

    Clients that are not browsers send no ``Origin`` and call by an address or a name they were
    given; a request without ``Host`` (HTTP/1.0, in-process) is not a browser's either.
    """

    _STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})

    def __init__(self, app: ASGIApp, *, allowed_hosts: Collection[str]) -> None:
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.names = frozenset(name.lower().rstrip(".") for name in allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.any_host:
            await self.app(scope, receive, send)
            return
        host = origin = None
        for name, value in scope["headers"]:
            if name == b"host":
                host = value.decode("latin-1")
            elif name == b"origin":
                origin = value.decode("latin-1")
        if host is not None and not self._allowed(_host_name(host)):
            message = f"this gateway is not served as {host!r} (see allowed_hosts)"
            await _send_error(scope, send, Error(kind="misdirected", message=message))
            return
        # Any page may open a WebSocket to any address (no CORS): an upgrade is as state
        # changing as a POST.
        changing = scope["type"] == "websocket" or scope["method"] in self._STATE_CHANGING
        if origin is not None and changing and not self._origin_allowed(origin, host):
            message = f"requests from pages of origin {origin!r} are refused"
            await _send_error(scope, send, Error(kind="forbidden", message=message))
            return
        await self.app(scope, receive, send)

    def _allowed(self, name: str) -> bool:
        return is_ip_literal(name) or name in self.names

    def _origin_allowed(self, origin: str, host: str | None) -> bool:
        try:
            parts = urlsplit(origin)
            origin_name = parts.hostname  # lowercased, without brackets and port
        except ValueError:
            return False
        if not origin_name or parts.scheme not in ("http", "https"):
            return False  # "null" (sandboxed frames, file: pages) and the like
        if host is not None and parts.netloc.lower() == host.lower():
            return True  # the gateway's own pages (the console)
        return origin_name.rstrip(".") in self.names or _is_loopback(origin_name)


def _host_name(host: str) -> str:
    """The name in a ``Host`` value, without the port and an IPv6 literal's brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _is_loopback(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class GuardedState(Protocol):
    """The slice of the gateway's state the guard reads (the key and limits) and counts in."""

    config: GatewayConfig
    in_flight_guarded: int


class GatewayGuard:
    """Checks the key, buffers the body up to the limit, and counts requests in flight."""

    def __init__(self, app: ASGIApp, *, state: GuardedState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        config = self.state.config
        if (
            config.api_key
            and scope["path"] not in _OPEN_PATHS
            and not scope["path"].startswith(_OPEN_PREFIXES)
            and not _key_ok(scope, config.api_key)
        ):
            await _send_error(
                scope, send, Error(kind="authentication", message="invalid or missing API key")
            )
            return
        if scope["type"] == "websocket":  # its turns are counted in flight as they run
            await self.app(scope, receive, send)
            return
        if scope["method"] in ("POST", "PUT"):
            body = await _read_body(scope, receive, config.max_body_bytes)
            if body is None:
                limit = config.max_body_bytes
                await _send_error(
                    scope,
                    send,
                    Error(kind="too_large", message=f"request body exceeds {limit} bytes"),
                )
                return
            receive = _replay(body, receive)
        if scope["path"] in _GENERATING:
            if self.state.in_flight_guarded >= config.max_in_flight:
                await _send_error(
                    scope,
                    send,
                    Error(
                        kind="overloaded",
                        message=f"too many requests in flight (limit {config.max_in_flight})",
                    ),
                    {"retry-after": "1"},
                )
                return
            self.state.in_flight_guarded += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.state.in_flight_guarded -= 1
            return
        await self.app(scope, receive, send)


def _key_ok(scope: Scope, expected: str) -> bool:
    given = ""
    for name, value in scope["headers"]:
        if name == b"authorization":
            text = value.decode("latin-1")
            if text[:7].lower() == "bearer ":
                given = text[7:].strip()
        elif name == b"x-api-key":
            given = value.decode("latin-1").strip()
    return bool(given) and hmac.compare_digest(given.encode(), expected.encode())


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None when it exceeds ``limit`` (by header or by counting)."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            return None
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
