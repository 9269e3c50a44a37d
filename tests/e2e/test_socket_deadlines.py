"""Every socket has a deadline: slow clients are closed, idle ones too, repeats are not logged."""

from __future__ import annotations

import logging
import socket
import sys
import time

import orjson
import pytest
from websockets.exceptions import ConnectionClosedOK
from websockets.sync.client import connect as ws_connect

import gateway.responses.websocket
import worker.serve.net
from gateway.app import create_app
from gateway.testing import ScriptedUpstream, ServerThread, text_script
from gateway.upstream import ModelInfo, StaticDirectory
from worker.serve.net import RepeatedLogFilter


@pytest.fixture
def fast_deadlines(monkeypatch):
    monkeypatch.setattr(worker.serve.net.DeadlineH11Protocol, "header_timeout_s", 0.5)
    monkeypatch.setattr(worker.serve.net.DeadlineH11Protocol, "body_timeout_s", 0.5)
    monkeypatch.setattr(worker.serve.net, "KEEP_ALIVE_S", 0.5)


@pytest.fixture
def server(fast_deadlines):
    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), ScriptedUpstream.of(*text_script("ok")))
    with ServerThread(create_app(directory)) as running:
        yield running


def _closed_within(sock: socket.socket, limit_s: float, trickle: bytes = b"") -> float:
    """Seconds until the server closes ``sock`` while we send ``trickle`` a byte at a time."""
    start = time.monotonic()
    sock.settimeout(0.1)
    sent = 0
    while time.monotonic() - start < limit_s:
        if sent < len(trickle):
            try:
                sock.send(trickle[sent : sent + 1])
            except OSError:
                return time.monotonic() - start
            sent += 1
        try:
            if sock.recv(1024) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - start
    raise AssertionError(f"still open after {limit_s}s")


def test_headers_sent_a_byte_at_a_time_are_cut_off(server) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        slow = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Pad: " + b"a" * 200
        assert _closed_within(sock, 5.0, slow) < 3.0


def test_a_body_that_never_arrives_is_cut_off(server) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
        )
        sock.sendall(head)
        assert _closed_within(sock, 5.0) < 3.0


def test_an_idle_connection_is_closed_and_a_healthy_one_is_served(server) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        sock.settimeout(5)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        assert _closed_within(sock, 5.0) < 3.0  # kept alive, then idle past the limit


def test_repeated_log_lines_are_held_back_and_counted() -> None:
    now = [0.0]
    flt = RepeatedLogFilter(every_s=10, clock=lambda: now[0])

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, None)

    assert flt.filter(record("accept failed"))
    assert not any(flt.filter(record("accept failed")) for _ in range(1000))
    assert flt.filter(record("another thing"))
    now[0] = 11.0
    again = record("accept failed")
    assert flt.filter(again) and "1000 more" in again.getMessage()


def test_the_open_files_limit_is_raised_to_the_hard_limit() -> None:
    import resource

    cap = worker.serve.net.raise_open_files_limit()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == hard or sys.platform == "darwin"  # macOS stops at OPEN_MAX
    assert 16 <= cap < soft


def _ws_turn(ws) -> list[dict]:
    """Send one Responses turn over ``ws`` and read its events up to the terminal one."""
    ws.send(orjson.dumps({"type": "response.create", "model": "m", "input": "x"}).decode())
    events = [orjson.loads(ws.recv(timeout=10))]
    while events[-1]["type"] not in ("response.completed", "response.failed", "error"):
        events.append(orjson.loads(ws.recv(timeout=10)))
    return events


def test_a_websocket_outlives_the_request_deadlines(server) -> None:
    """The upgrade request's body deadline must not follow the connection into WebSocket mode:
    a socket that lives past it (idle, then a turn) is served, not dropped without a close."""
    url = server.url.replace("http://", "ws://") + "/v1/responses"
    with ws_connect(url) as ws:
        assert _ws_turn(ws)[-1]["type"] == "response.completed"
        time.sleep(1.5)  # three times the (shortened) header and body deadlines
        assert _ws_turn(ws)[-1]["type"] == "response.completed"


def test_an_idle_websocket_is_closed_with_a_close_frame(server, monkeypatch) -> None:
    monkeypatch.setattr(gateway.responses.websocket, "IDLE_S", 0.3)
    url = server.url.replace("http://", "ws://") + "/v1/responses"
    with ws_connect(url) as ws:
        with pytest.raises(ConnectionClosedOK) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000


def test_a_websocket_at_its_age_limit_is_told_and_closed(server, monkeypatch) -> None:
    """At the connection's age limit (60 minutes; shortened here) an idle socket gets the
    spec's ``websocket_connection_limit_reached`` error, then a clean close frame."""
    monkeypatch.setattr(gateway.responses.websocket, "MAX_AGE_S", 1.0)
    url = server.url.replace("http://", "ws://") + "/v1/responses"
    with ws_connect(url) as ws:
        assert _ws_turn(ws)[-1]["type"] == "response.completed"
        error = orjson.loads(ws.recv(timeout=10))  # nothing sent: the limit comes to us
        assert error["type"] == "error"
        assert error["error"]["code"] == "websocket_connection_limit_reached"
        with pytest.raises(ConnectionClosedOK) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000
