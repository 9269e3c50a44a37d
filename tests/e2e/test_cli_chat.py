"""``mesh chat``: the stream parser, finding the node, and the command against a real gateway."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.events import Error
from gateway.testing import ScriptedUpstream, ServerThread, text_script
from gateway.upstream import ModelInfo, StaticDirectory
from mesh.cli import app
from mesh.cli.chat import ChatError, default_model, find_node, parse_chat_stream

runner = CliRunner()


def flat(text: str) -> str:
    """Output with rich's line wrapping undone."""
    return " ".join(text.split())


def sse(*chunks: object) -> list[str]:
    return [f"data: {orjson.dumps(c).decode()}" for c in chunks] + ["", "data: [DONE]"]


# ---------------------------------------------------------------- pure pieces


def test_parse_chat_stream_splits_reasoning_and_text() -> None:
    lines = [
        ": keep-alive",
        *sse(
            {"choices": [{"delta": {"role": "assistant"}}]},
            {"choices": [{"delta": {"reasoning_content": "hmm"}}]},
            {"choices": [{"delta": {"reasoning": " ok"}}]},
            {"choices": [{"delta": {"content": "Hi"}}]},
            {"choices": [{"delta": {"content": "!"}, "finish_reason": "stop"}]},
            {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}},
        ),
        'data: {"choices": [{"delta": {"content": "after done"}}]}',
    ]
    assert list(parse_chat_stream(lines)) == [
        ("reasoning", "hmm"),
        ("reasoning", " ok"),
        ("text", "Hi"),
        ("text", "!"),
        ("usage", "4"),
    ]


def test_parse_chat_stream_raises_on_error_events_and_garbage() -> None:
    with pytest.raises(ChatError, match="worker fell over"):
        list(parse_chat_stream(sse({"error": {"message": "worker fell over", "type": "x"}})))
    with pytest.raises(ChatError, match="malformed"):
        list(parse_chat_stream(["data: {not json"]))


def test_find_node_reads_node_json(tmp_path: Path) -> None:
    (tmp_path / "node.json").write_bytes(
        orjson.dumps({"url": "http://127.0.0.1:9337/", "pid": os.getpid(), "api_key": "k"})
    )
    node = find_node(tmp_path)
    assert node.url == "http://127.0.0.1:9337"
    assert node.api_key == "k"


def test_find_node_explains_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ChatError, match=r"no node is running.*mesh up"):
        find_node(tmp_path)
    (tmp_path / "node.json").write_text("{")
    with pytest.raises(ChatError, match="cannot read"):
        find_node(tmp_path)
    (tmp_path / "node.json").write_text('{"pid": 1}')
    with pytest.raises(ChatError, match="no node url"):
        find_node(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "node.json").write_bytes(orjson.dumps({"url": "http://x", "pid": dead.pid}))
    with pytest.raises(ChatError, match=rf"pid {dead.pid}.*not running"):
        find_node(tmp_path)


# ---------------------------------------------------------------- against a gateway


class Node:
    def __init__(self, api_key: str | None = None) -> None:
        self.tiny = ScriptedUpstream.of(
            *text_script("The answer is 4.", reasoning="Two plus two.", chunk=3), name="local"
        )
        self.broken = ScriptedUpstream.of(Error(kind="upstream", message="worker crashed"))
        directory = StaticDirectory()
        directory.add(ModelInfo(id="tiny"), self.tiny)
        directory.add(ModelInfo(id="broken"), self.broken)
        self.server = ServerThread(create_app(directory, GatewayConfig(api_key=api_key)))


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    n = Node()
    with n.server:
        yield n


def chat(*args: str, input: str | None = None):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["chat", *args], input=input)


def assert_clean_failure(result, needle: str) -> None:  # type: ignore[no-untyped-def]
    assert result.exit_code == 1, result.output
    assert needle in flat(result.stderr)
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_one_shot_streams_text_and_reasoning(node: Node) -> None:
    result = chat("--url", node.server.url + "/v1/", "--model", "tiny", "What is 2+2?")
    assert result.exit_code == 0, result.output
    assert result.stdout == "Two plus two.\nThe answer is 4.\n"
    assert flat(result.stderr).startswith("local · TTFT")
    assert "tok/s" in result.stderr  # the scripted usage says 5 completion tokens
    sent = node.tiny.requests[-1]
    assert sent.model == "tiny" and sent.messages[-1].content == "What is 2+2?"


def test_node_is_found_through_home(node: Node, tmp_path: Path) -> None:
    (tmp_path / "node.json").write_bytes(orjson.dumps({"url": node.server.url, "pid": os.getpid()}))
    result = chat("--home", str(tmp_path), "-m", "tiny", "hi")
    assert result.exit_code == 0, result.output
    assert "The answer is 4." in result.stdout


def test_unknown_model_is_one_clear_sentence(node: Node) -> None:
    result = chat("--url", node.server.url, "--model", "nope", "hi")
    assert_clean_failure(result, "model 'nope' is not served in this mesh")
    assert "available: tiny, broken)" in flat(result.stderr)


def test_upstream_error_is_reported(node: Node) -> None:
    result = chat("--url", node.server.url, "--model", "broken", "hi")
    assert_clean_failure(result, "worker crashed")


def test_no_node_bad_url_and_refused_connection(tmp_path: Path) -> None:
    assert_clean_failure(chat("--home", str(tmp_path), "hi"), "no node is running")
    assert_clean_failure(chat("--url", "not a url", "hi"), "is not a valid node URL")
    with ServerThread(create_app(StaticDirectory())) as server:
        url = server.url  # a port that was just served and is now closed
    assert_clean_failure(chat("--url", url, "hi"), f"cannot reach a node at {url}")


def test_repl_switches_models_and_keeps_history(node: Node) -> None:
    script = "\n".join(
        ["/model", "/model nope", "/model tiny", "first", "second", "/models", "/bogus", "/quit"]
    )
    calls = node.tiny.calls
    result = chat("--url", node.server.url, input=script + "\n")
    assert result.exit_code == 0, result.output
    assert "current model: tiny" in flat(result.stderr)
    assert "model 'nope' is not served" in flat(result.stderr)
    assert "now talking to tiny" in flat(result.stderr)
    assert "tiny, broken" in flat(result.stderr)
    assert "unknown command /bogus" in flat(result.stderr)
    assert result.stdout.count("The answer is 4.") == 2
    assert node.tiny.calls == calls + 2
    second = node.tiny.requests[-1].messages
    assert [m.role for m in second] == ["user", "assistant", "user"]
    assert second[1].content == "The answer is 4."


def test_repl_ends_on_eof_and_survives_errors(node: Node) -> None:
    result = chat("--url", node.server.url, "-m", "broken", input="hello\n")
    assert result.exit_code == 0, result.output
    assert "worker crashed" in flat(result.stderr)


def test_api_key_is_sent_and_its_absence_explained() -> None:
    guarded = Node(api_key="sekret")
    with guarded.server:
        url = guarded.server.url
        assert_clean_failure(chat("--url", url, "-m", "tiny", "hi"), "wants an API key")
        ok = chat("--url", url, "-m", "tiny", "--api-key", "sekret", "hi")
        assert ok.exit_code == 0, ok.output
        assert "The answer is 4." in ok.stdout


def test_a_node_without_models_says_so() -> None:
    with ServerThread(create_app(StaticDirectory())) as server:
        result = chat("--url", server.url, "hi")
        assert_clean_failure(result, "the node serves no models yet")
        explicit = chat("--url", server.url, "-m", "mesh", "hi")
        assert_clean_failure(explicit, "model 'mesh' is not served in this mesh (no models")


def test_without_model_mesh_is_preferred_else_the_first_model(node: Node) -> None:
    result = chat("--url", node.server.url, "hi")  # this node runs no mixture-of-agents
    assert result.exit_code == 0, result.output
    assert "using tiny (this node offers no `mesh`)" in flat(result.stderr)
    assert node.tiny.requests[-1].model == "tiny"
    assert default_model(["tiny", "mesh"]) == "mesh"


def test_prompt_from_stdin(node: Node) -> None:
    result = chat("--url", node.server.url, "-m", "tiny", "-", input="a question\nin two lines\n")
    assert result.exit_code == 0, result.output
    assert node.tiny.requests[-1].messages[-1].content == "a question\nin two lines"
    assert_clean_failure(chat("--url", node.server.url, "-", input=""), "stdin was empty")


def test_a_connection_cut_mid_answer_is_one_sentence() -> None:
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def cut_short(request):  # type: ignore[no-untyped-def]
        # Read the whole request first: a socket closed with request bytes still unread (the
        # body can trail the headers) is reset (RST), not closed (FIN); both are covered below.
        await request.body()

        async def body():  # type: ignore[no-untyped-def]
            yield b'data: {"choices": [{"delta": {"content": "Half an"}}]}\n\n'
            raise ConnectionResetError("the node died")  # uvicorn drops the connection

        return StreamingResponse(body(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/chat/completions", cut_short, methods=["POST"])])
    with ServerThread(app) as server:
        result = chat("--url", server.url, "-m", "tiny", "hi")
    assert result.stdout.startswith("Half an")
    assert_clean_failure(result, "closed the connection mid-answer")


class CuttingServer:
    """A raw TCP server that reads one whole request, optionally starts a chunked SSE answer,
    then ends the connection with a FIN (close) or an RST (SO_LINGER 0): each cut exactly."""

    def __init__(self, *, answer_first: bool, reset: bool) -> None:
        self.answer_first, self.reset = answer_first, reset
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve_one, daemon=True)

    def _serve_one(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(65536)
            head, _, body = request.partition(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.lower().split(b"\r\n")
                if line.startswith(b"content-length:")
            )
            while len(body) < length:
                body += conn.recv(65536)
            if self.answer_first:
                chunk = b'data: {"choices": [{"delta": {"content": "Half an"}}]}\n\n'
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                    + f"{len(chunk):x}\r\n".encode()
                    + chunk
                    + b"\r\n"
                )
            if self.reset:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def __enter__(self) -> CuttingServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(timeout=10)
        self._listener.close()


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
@pytest.mark.parametrize("answer_first", [True, False], ids=["mid-answer", "before-answering"])
def test_every_way_a_connection_is_cut_is_one_sentence(answer_first: bool, reset: bool) -> None:
    with CuttingServer(answer_first=answer_first, reset=reset) as server:
        result = chat("--url", server.url, "-m", "tiny", "hi")
    if answer_first:
        assert result.stdout.startswith("Half an")
        assert_clean_failure(result, "closed the connection mid-answer")
    else:
        assert "Half an" not in result.stdout
        assert_clean_failure(result, "closed the connection before answering")
