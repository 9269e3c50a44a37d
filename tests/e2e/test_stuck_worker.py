"""A worker stopped under load (issue #44: SIGSTOP; a deadlock or a swapped-out machine looks the
same): two real ``mesh up`` nodes on loopback, A and B, serve the tiny model, and clients stream
and ask both. A's worker is stopped; its node finds it within its health checks (default: 3
missed checks 2 s apart), withdraws the model (B stops routing there), kills the worker, which
fails its requests over to B (or ends a committed one with an error event), and restarts it.
No request hangs: each one completes or fails cleanly within the bound below.

With the health checks off, the stream deadlines alone (here 2 s) end the stopped worker's
requests: a stream under way with its error event, a new request with a 504.

Before the fix (no health check, no stream deadlines) the requests on the stopped worker wait
until the client's own timeout (here 60 s): the outcome assertions fail with "hung"."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from mesh_processes import Running, run_mesh, wait_for

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

CLIENT_TIMEOUT_S = 60.0  # a request still open after this is a hung one
# Found within 3 checks 2 s apart (each waits 2 s for its answer), killed, the request retried
# after the 0.75 s backoff on the next route, and answered there: well under this, also for a
# request forwarded A -> B -> A's stuck worker -> back to B.
BOUND_S = 20.0
LOAD_AFTER_STOP_S = 12.0
LONG = 400  # tokens: an answer A's worker is still writing when it stops


@dataclass
class Outcome:
    node: str
    stream: bool
    took: float
    result: str  # "ok", "error event", "status NNN", "hung", "broke: ..."


def ask(client: httpx.Client, node: str, stream: bool, tokens: int = 24) -> Outcome:
    body = {
        "model": "model",
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": tokens,  # random weights never stop early: each answer is this long
        "stream": stream,
    }
    started = time.monotonic()
    try:
        if stream:
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    result = f"status {response.status_code}"
                else:
                    lines = []
                    for line in response.iter_lines():  # keep-alives come while it waits
                        if time.monotonic() - started > CLIENT_TIMEOUT_S:
                            raise httpx.ReadTimeout("the client gives up")
                        if line.startswith("data:"):
                            lines.append(line)
                    erred = any(line.startswith('data: {"error"') for line in lines)
                    assert lines[-1] == "data: [DONE]", lines[-3:]  # the terminal, always
                    result = "error event" if erred else "ok"
        else:
            response = client.post("/v1/chat/completions", json=body)
            result = "ok" if response.status_code == 200 else f"status {response.status_code}"
            if response.status_code != 200:
                assert "error" in response.json(), response.text
    except httpx.TimeoutException:
        result = "hung"
    except (httpx.HTTPError, AssertionError) as exc:
        result = f"broke: {type(exc).__name__}: {exc}"
    return Outcome(node, stream, time.monotonic() - started, result)


def load(url: str, node: str, stream: bool, stop: threading.Event, out: list[Outcome]) -> None:
    # A's answers are long, so the stop finds some in the middle of one (a streamed one
    # committed, one for a waiting client not); B's are short.
    tokens = LONG if node == "A" else 24
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
        while not stop.is_set():
            out.append(ask(client, node, stream, tokens))


def status(url: str) -> dict:
    return httpx.get(url + "/api/status", timeout=10).json()


def worker_state(url: str) -> str | None:
    """The node's word for its worker's state (None: a node that has none)."""
    return status(url)["workers"]["model"].get("state")


def offers_model(b_url: str) -> bool:
    """Whether B's peer table says A serves the model (A's gossip)."""
    (a_row,) = status(b_url)["peers"]
    return any(ad["name"] == "model" for ad in a_row["models"])


@pytest.mark.timeout(300)
def test_a_stopped_worker_under_load_is_withdrawn_restarted_and_hangs_no_request(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    a = Running(tmp_path / "a", "--model", str(tiny_model_dir))
    b: Running | None = None
    worker = a.info["workers"]["model"]["pid"]
    try:
        made = run_mesh("invite", "--home", str(a.home), "--ttl", "10m")
        assert made.returncode == 0, made.stderr
        token = made.stdout.strip().splitlines()[-1]
        b = Running(tmp_path / "b", "--model", str(tiny_model_dir), "--join", token)
        wait_for(lambda: offers_model(b.url), 30, "A's model offered to B")

        stop = threading.Event()
        outcomes: list[Outcome] = []
        threads = [
            threading.Thread(target=load, args=(url, name, stream, stop, outcomes))
            for url, name in ((a.url, "A"), (b.url, "B"))
            for stream in (True, False)
        ]
        for thread in threads:
            thread.start()
        time.sleep(1.5)
        before = len(outcomes)
        os.kill(worker, signal.SIGSTOP)
        stopped_at = time.monotonic()
        # Meanwhile: when A's node found it (its state leaves "serving") and when B stopped
        # seeing the model offered (gossip), while the load goes on.
        found_s = withdrawn_s = None
        while (now := time.monotonic()) - stopped_at < LOAD_AFTER_STOP_S:
            with contextlib.suppress(httpx.HTTPError):
                if found_s is None and worker_state(a.url) not in (None, "serving"):
                    found_s = now - stopped_at
                if withdrawn_s is None and not offers_model(b.url):
                    withdrawn_s = now - stopped_at
            time.sleep(0.2)
        stop.set()
        for thread in threads:
            thread.join(CLIENT_TIMEOUT_S + 10)
        assert not any(thread.is_alive() for thread in threads), "a request never ended"

        broken = [o for o in outcomes if o.result not in ("ok", "error event", "status 503")]
        assert not broken, broken
        slow = [o for o in outcomes if o.took > BOUND_S]
        assert not slow, slow
        assert before > 0 and len(outcomes) > before + 8, outcomes  # load ran throughout
        assert sum(o.result == "ok" for o in outcomes) > len(outcomes) // 2, outcomes
        assert found_s is not None and found_s < 10.0, found_s  # 3 checks 2 s apart, +2 s
        assert withdrawn_s is not None and withdrawn_s < 12.0, withdrawn_s

        def back() -> bool:
            picture = status(a.url)["workers"]["model"]
            return picture["state"] == "serving" and picture["restarts"] == 1

        wait_for(back, 120, "A's worker restarted")
        wait_for(lambda: offers_model(b.url), 30, "A's model offered again")
        assert ask(httpx.Client(base_url=a.url, timeout=30), "A", False).result == "ok"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)  # before the fix nothing kills it: let it stop
        out_b = b.stop() if b is not None else ""
        print("---- node A ----\n" + a.stop())
        print("---- node B ----\n" + out_b)


@pytest.mark.timeout(120)
def test_the_stream_deadlines_alone_end_a_stopped_workers_requests(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Health checks off, 2 s deadlines: a stream under way when the worker stops ends with its
    error event, a new request is a 504 (first token, tried twice), and the worker, let go
    again, serves as before."""
    a = Running(
        tmp_path / "a", "--model", str(tiny_model_dir), "--worker-health-interval", "0",
        "--first-token-timeout", "2", "--idle-token-timeout", "2",
    )  # fmt: skip
    worker = a.info["workers"]["model"]["pid"]
    body = {"model": "model", "messages": [{"role": "user", "content": "Go on."}]}
    long, short = body | {"max_tokens": 4000, "stream": True}, body | {"max_tokens": 3}
    try:
        with httpx.Client(base_url=a.url, timeout=CLIENT_TIMEOUT_S) as client:
            lines: list[str] = []
            stopped_at = 0.0
            with client.stream("POST", "/v1/chat/completions", json=long) as response:
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        lines.append(line)
                    if not stopped_at and '"content"' in line:
                        os.kill(worker, signal.SIGSTOP)
                        stopped_at = time.monotonic()
            ended_s = time.monotonic() - stopped_at
            assert lines[-1] == "data: [DONE]", lines[-3:]
            assert lines[-2].startswith('data: {"error"'), lines[-3:]
            assert "mid-answer" in lines[-2] and ended_s < 6.0, (lines[-2], ended_s)
            started = time.monotonic()
            refused = client.post("/v1/chat/completions", json=short)
            assert refused.status_code == 504, refused.text
            assert "no first token within 2 s" in refused.text
            assert time.monotonic() - started < 10.0
            os.kill(worker, signal.SIGCONT)
            again = client.post("/v1/chat/completions", json=short)
            assert again.status_code == 200, again.text
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)
        print("---- node A ----\n" + a.stop())
