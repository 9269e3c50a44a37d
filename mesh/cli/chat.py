"""``mesh chat``: talk to the mesh from a terminal, one-shot or as a small REPL.

The node is found through ``<home>/node.json`` (written by ``mesh up``) unless ``--url`` is
given; answers stream from ``/v1/chat/completions`` with reasoning printed dimmed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import typer

from gateway.upstream import MESH_MODEL
from mesh.cli.app import HomeOption, app, console, err_console, fail, resolve_home
from mesh.identity import short_id
from mesh.node_file import NodeFileError, node_file_path, read_node_file

HELP_LINE = "/model NAME switches model, /models lists them, /new starts over, /quit leaves"


class ChatError(Exception):
    """A failure a person can cause or fix; ``str()`` is one clear sentence."""


@dataclass(frozen=True)
class NodeAddress:
    url: str
    api_key: str | None = None
    csrf: str | None = None  # the node's token for admin POSTs (mesh invite, members remove)


def find_node(home: Path) -> NodeAddress:
    """The running node recorded in ``<home>/node.json``."""
    try:
        info = read_node_file(home)
    except NodeFileError as exc:
        raise ChatError(str(exc)) from None
    pid = info.get("pid")
    if isinstance(pid, int) and not _process_alive(pid):
        raise ChatError(
            f"the node recorded in {node_file_path(home)} (pid {pid}) is not running; "
            "start it with `mesh up`"
        )
    return NodeAddress(
        url=info["url"].rstrip("/"), api_key=info.get("api_key"), csrf=info.get("csrf")
    )


def _base_url(url: str) -> str:
    """Accept the gateway's base URL as people paste it: with or without ``/v1`` or a slash."""
    url = url.strip().rstrip("/")
    return url.removesuffix("/v1")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def parse_chat_stream(lines: Iterable[str]) -> Iterator[tuple[str, str]]:
    """Chat-completions SSE lines → ``("reasoning" | "text", fragment)`` and, from the usage
    chunk, ``("usage", completion token count)``; raises on error events."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise ChatError(f"the node sent a malformed stream line: {data[:80]!r}") from None
        if "error" in chunk:
            raise ChatError(_error_message(chunk, "the node reported an error"))
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            yield "usage", str(usage["completion_tokens"])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                yield "reasoning", reasoning
            if delta.get("content"):
                yield "text", delta["content"]


def _error_message(body: object, default: str) -> str:
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    return default


@dataclass
class ChatSession:
    """One conversation against one node: history, the current model, the HTTP client."""

    url: str
    model: str
    client: httpx.Client
    api_key: str | None = None
    messages: list[dict] = field(default_factory=list)
    last_headers: dict[str, str] = field(default_factory=dict)

    def _headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def models(self) -> list[str]:
        """Every model the node offers (``mesh`` among them when it runs mixture-of-agents)."""
        response = self._call("GET", "/v1/models")
        if response.status_code != 200:
            raise ChatError(self._status_message(response))
        return [m["id"] for m in response.json().get("data", [])]

    def stream(self, prompt: str) -> Iterator[tuple[str, str]]:
        """Send ``prompt`` and yield the answer's fragments; the answer joins the history."""
        self.messages.append({"role": "user", "content": prompt})
        body = {
            "model": self.model,
            "messages": self.messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        answer: list[str] = []
        try:
            with (
                _transport_errors(self.url),
                self.client.stream(
                    "POST", self.url + "/v1/chat/completions", json=body, headers=self._headers()
                ) as response,
            ):
                if response.status_code != 200:
                    response.read()
                    raise ChatError(self._status_message(response))
                self.last_headers = dict(response.headers)
                try:
                    for kind, fragment in parse_chat_stream(response.iter_lines()):
                        if kind == "text":
                            answer.append(fragment)
                        yield kind, fragment
                except httpx.TransportError as exc:
                    raise ChatError(_transport_message(self.url, exc, answering=True)) from None
        finally:
            if answer:
                self.messages.append({"role": "assistant", "content": "".join(answer)})
            else:
                self.messages.pop()  # nothing came back: forget the unanswered turn

    def _call(self, method: str, path: str) -> httpx.Response:
        with _transport_errors(self.url):
            return self.client.request(method, self.url + path, headers=self._headers())

    def _status_message(self, response: httpx.Response) -> str:
        try:
            detail = _error_message(response.json(), "")
        except ValueError:
            detail = response.text.strip()[:200]
        if response.status_code == 401:
            return "the node wants an API key: pass --api-key or set MLX_MESH_API_KEY"
        if response.status_code == 404:
            return f"model '{self.model}' is not served in this mesh{self._available_hint()}"
        return f"the node answered {response.status_code}: {detail or response.reason_phrase}"

    def _available_hint(self) -> str:
        try:
            names = self.models()
        except ChatError:
            return ""
        return f" (available: {', '.join(names)})" if names else " (no models are served yet)"


@contextlib.contextmanager
def _transport_errors(url: str) -> Iterator[None]:
    """Turn httpx's transport errors (connecting or mid-stream) into one-sentence ChatErrors."""
    try:
        yield
    except httpx.HTTPError as exc:
        raise ChatError(_transport_message(url, exc)) from None


def _transport_message(url: str, exc: httpx.HTTPError, *, answering: bool = False) -> str:
    """One sentence for ``exc``; ``answering`` once the response has started streaming."""
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError):
        # A node that dies sends FIN (RemoteProtocolError) or, when request bytes are still
        # unread on its side, RST (ReadError, ECONNRESET): the same event to the person.
        when = "mid-answer" if answering else "before answering"
        return f"the node at {url} closed the connection {when}"
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL):
        return f"'{url}' is not a valid node URL (expected http://host:port)"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot reach a node at {url}: is `mesh up` running?"
    if isinstance(exc, httpx.TimeoutException):
        return f"the node at {url} did not answer in time"
    return f"talking to {url} failed: {exc}"


def default_model(offered: list[str]) -> str:
    """``mesh`` where the node runs mixture-of-agents, else the first model it offers."""
    if MESH_MODEL in offered:
        return MESH_MODEL
    if not offered:
        raise ChatError("the node serves no models yet; start one with `mesh up --model NAME`")
    err_console.print(f"using {offered[0]} (this node offers no `mesh`)", style="dim")
    return offered[0]


def print_answer(session: ChatSession, prompt: str) -> None:
    """Stream one answer to the terminal: reasoning dimmed, then the text, then a footer."""
    started = time.monotonic()
    first: float | None = None
    tokens: int | None = None
    last_kind = None
    for kind, fragment in session.stream(prompt):
        if kind == "usage":
            tokens = int(fragment)
            continue
        first = first or time.monotonic()
        if last_kind == "reasoning" and kind == "text":
            console.print()
        last_kind = kind
        style = "dim italic" if kind == "reasoning" else None
        console.print(fragment, end="", style=style, markup=False, highlight=False, soft_wrap=True)
    console.print()
    _print_footer(session.last_headers, started, first, tokens)


def _print_footer(
    headers: dict[str, str], started: float, first: float | None, tokens: int | None
) -> None:
    """``route · peer · winner · TTFT · tok/s`` on stderr, so stdout stays just the answer."""
    route, peer = headers.get("x-route"), headers.get("x-peer")
    parts = [route] if route else []
    if peer and peer not in ("local", route):
        parts.append(f"peer {short_id(peer)}")
    if headers.get("x-moa-winner"):
        parts.append(f"winner {headers['x-moa-winner']}")
    if first is not None:
        parts.append(f"TTFT {1000 * (first - started):.0f} ms")
        elapsed = time.monotonic() - first
        if tokens is not None and tokens > 1 and elapsed > 0:
            parts.append(f"{tokens / elapsed:.1f} tok/s")
    if parts:
        err_console.print(" · ".join(parts), style="dim", markup=False, highlight=False)


def run_repl(session: ChatSession) -> None:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    err_console.print(
        f"chatting with [bold]{session.model}[/] at {session.url} – {HELP_LINE}", highlight=False
    )
    while True:
        try:
            line = console.input("[bold cyan]you>[/] ").strip()
        except (EOFError, KeyboardInterrupt):
            console.print()
            return
        if not line:
            continue
        if line.startswith("/"):
            if not _repl_command(session, line):
                return
            continue
        try:
            print_answer(session, line)
        except ChatError as exc:
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False)
        except KeyboardInterrupt:
            console.print()
            err_console.print("stopped", style="yellow")


def _repl_command(session: ChatSession, line: str) -> bool:
    """Handle a ``/command``; False means leave the REPL."""
    name, _, arg = line.partition(" ")
    arg = arg.strip()
    if name in ("/quit", "/exit", "/q"):
        return False
    if name == "/new":
        session.messages.clear()
        err_console.print("new conversation", style="dim")
    elif name == "/models":
        try:
            err_console.print(", ".join(session.models()), highlight=False)
        except ChatError as exc:
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False)
    elif name == "/model":
        _switch_model(session, arg)
    else:
        err_console.print(f"unknown command {name}; {HELP_LINE}", highlight=False)
    return True


def _switch_model(session: ChatSession, name: str) -> None:
    if not name:
        err_console.print(f"current model: {session.model}", highlight=False)
        return
    try:
        known = session.models()
    except ChatError as exc:
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False)
        return
    if name not in known:
        err_console.print(
            f"[bold red]error:[/] model '{name}' is not served in this mesh "
            f"(available: {', '.join(known) or 'none'})",
            highlight=False,
        )
        return
    session.model = name
    err_console.print(f"now talking to {name}", style="dim", highlight=False)


@app.command("chat")
def chat_command(
    prompt: str | None = typer.Argument(
        None, help="Ask once and exit (`-` reads it from stdin); without it, a REPL."
    ),
    model: str | None = typer.Option(
        None, "--model", "-m", help="A model id, or `mesh` (MoA; the default where offered)."
    ),
    url: str | None = typer.Option(None, "--url", help="Gateway URL (default: the local node)."),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="MLX_MESH_API_KEY", help="Bearer key, if the node needs one."
    ),
    home: Path | None = HomeOption,
) -> None:
    """Chat with the mesh: streamed answers, reasoning dimmed."""
    try:
        node = NodeAddress(_base_url(url)) if url else find_node(resolve_home(home))
    except ChatError as exc:
        raise fail(str(exc)) from None
    timeout = httpx.Timeout(10.0, read=None)  # answers may think for a long time
    with httpx.Client(timeout=timeout) as client:
        session = ChatSession(
            url=node.url, model=model or MESH_MODEL, client=client, api_key=api_key or node.api_key
        )
        if model is None:
            try:
                session.model = default_model(session.models())
            except ChatError as exc:
                raise fail(str(exc)) from None
        if prompt is None:
            run_repl(session)
            return
        if prompt == "-":
            prompt = sys.stdin.read().strip()
            if not prompt:
                raise fail("nothing to ask: stdin was empty")
        try:
            print_answer(session, prompt)
        except ChatError as exc:
            raise fail(str(exc)) from None
        except KeyboardInterrupt:
            raise fail("stopped", code=130) from None
