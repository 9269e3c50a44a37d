"""Two real ``mesh up`` processes on loopback with the tiny model: B (no worker) joins A's mesh
with an invite from ``mesh invite`` – through a UDP chaos proxy – and serves A's model. Under
greedy decoding and 20 % datagram loss on the B–A tunnel, the text that streams through B
equals a direct request to A, for all three client APIs. Then B restarts
without a token and serves again (rejoin by key); ``mesh status`` shows the peer. Separately,
A killed mid-stream ends B's client stream with an error event within 5 s, once, no hang."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import openai
import orjson
import pytest
from mesh_processes import Running, mesh_command, wait_for

from lab.chaos import ChaosProxy
from mesh.membership.invite import decode_invite

MAX_TOKENS = 6


def _texts(url: str, model: str) -> dict[str, str]:
    """The streamed text of one greedy request per client API."""
    prompt = [{"role": "user", "content": "Say something."}]
    out: dict[str, str] = {}
    with openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as client:
        chunks = client.chat.completions.create(
            model=model, messages=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        out["chat"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        events = client.responses.create(
            model=model, input=prompt, max_output_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        out["responses"] = "".join(
            e.delta for e in events if e.type == "response.output_text.delta"
        )
    with anthropic.Anthropic(base_url=url, api_key="k", max_retries=0) as client:
        events = client.messages.create(
            model=model,
            messages=prompt,
            max_tokens=MAX_TOKENS,
            stream=True,
            extra_body={"temperature": 0},  # this SDK version has no temperature argument
        )
        out["messages"] = "".join(
            e.delta.text
            for e in events
            if e.type == "content_block_delta" and e.delta.type == "text_delta"
        )
    return out


class ProxyThread:
    """A :class:`ChaosProxy` on its own event loop in a thread (this test is synchronous)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.proxy = ChaosProxy((host, int(port)), seed=11)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._call(self.proxy.start())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    async def _set(self, **faults) -> None:
        self.proxy.set_faults(**faults)

    def set_loss(self, loss: float) -> None:
        self._call(self._set(loss=loss))

    def close(self) -> None:
        self._call(self.proxy.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def _model_ids(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(url + "/v1/models", timeout=5).json()["data"]]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_two_nodes_forward_join_and_rejoin(tiny_model_dir, tmp_path):
    a = Running(tmp_path / "a", "--model", str(tiny_model_dir))
    b = proxy = None
    try:
        invite = subprocess.run(
            mesh_command("invite", "--home", str(a.home), "--ttl", "10m"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert invite.returncode == 0, invite.stderr
        token = invite.stdout.strip().splitlines()[-1]
        assert token.startswith("mlxmesh1.")
        decoded = decode_invite(token)
        proxy = ProxyThread(decoded.addresses[0])
        via_proxy = decoded.model_copy(update={"addresses": [f"127.0.0.1:{proxy.proxy.port}"]})

        b = Running(
            tmp_path / "b", "--no-worker", "--join", via_proxy.encode(), "--moa-policy", "consensus"
        )
        wait_for(lambda: "model" in _model_ids(b.url), 30, "A's model listed on B")

        direct = _texts(a.url, "model")
        proxy.set_loss(0.2)
        via_b = _texts(b.url, "model")
        proxy.set_loss(0.0)
        assert all(direct.values()), direct  # the model produced text on every API
        assert via_b == direct, (via_b, direct)
        dropped = proxy.proxy.stats["upstream"].dropped + proxy.proxy.stats["downstream"].dropped
        assert dropped > 0

        body = {"model": "model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        response = httpx.post(b.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200
        assert response.headers["x-route"] == "peer"
        # model="mesh" on B mixes over the mesh: samples of A's model, through the tunnel.
        assert "mesh" in _model_ids(b.url)
        mixed = httpx.post(
            b.url + "/v1/chat/completions", json=body | {"model": "mesh"}, timeout=60
        )
        assert mixed.status_code == 200, mixed.text
        assert mixed.json()["choices"][0]["message"]["content"]
        assert mixed.headers["x-moa-policy"] == "consensus"  # --moa-policy reached the arbiter

        _stored_responses_are_served_by_any_node(a.url, b.url)

        # Every request leaves a row in the node's request log (default: HOME/requests.jsonl),
        # written after the response ended – so wait for it rather than read at once.
        def logged_models() -> set[str]:
            lines = (b.home / "requests.jsonl").read_bytes().splitlines()
            return {orjson.loads(line)["model"] for line in lines}

        wait_for(lambda: logged_models() >= {"model", "mesh"}, 10, "request log rows")

        status = subprocess.run(
            mesh_command("status", "--home", str(b.home), "--json"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        peers = orjson.loads(status.stdout)["peers"]
        assert [p["state"] for p in peers] == ["up"], peers
        assert [m["name"] for m in peers[0]["models"]] == ["model"]
        assert response.headers["x-peer"] == peers[0]["node_id"]

        # A restarted member comes back without a token: members know each other by key.
        b.stop()
        b = Running(tmp_path / "b", "--no-worker")
        wait_for(lambda: "model" in _model_ids(b.url), 30, "A's model listed on restarted B")
        assert _texts(b.url, "model")["chat"] == direct["chat"]

    finally:
        # Shown by pytest only if the test failed: what each node said.
        if b is not None:
            print("---- node B ----\n" + b.stop())
        print("---- node A ----\n" + a.stop())
        if proxy is not None:
            print("---- proxy ----", proxy.proxy.stats)
            proxy.close()


def _stored_responses_are_served_by_any_node(a_url: str, b_url: str) -> None:
    """A response belongs to the node that made it; any node retrieves, continues and deletes
    it (fetched from the owner over the tunnel)."""
    with (
        openai.OpenAI(base_url=a_url + "/v1", api_key="k", max_retries=0) as on_a,
        openai.OpenAI(base_url=b_url + "/v1", api_key="k", max_retries=0) as on_b,
    ):
        made = on_a.responses.create(model="model", input="x", max_output_tokens=2)
        assert on_b.responses.retrieve(made.id).output_text == made.output_text
        assert on_b.responses.input_items.list(made.id).data[0].content[0].text == "x"
        follow = on_b.responses.create(
            model="model", input="y", previous_response_id=made.id, max_output_tokens=2
        )
        assert on_a.responses.retrieve(follow.id).id == follow.id  # stored on B, read from A
        on_b.responses.delete(made.id)
        with pytest.raises(openai.NotFoundError):
            on_a.responses.retrieve(made.id)
        with pytest.raises(openai.NotFoundError):
            on_b.responses.create(model="model", input="z", previous_response_id=made.id)


KILL_TO_ERROR_S = 5.0  # the bound; default pings detect a dead peer within 4.4 s


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_killed_mid_stream_ends_the_client_stream_with_an_error(tiny_model_dir, tmp_path):
    """A is SIGKILLed while B's client streams A's model: with the node's default ping
    settings the client gets the chat error event and ``[DONE]`` within 5 s of the kill,
    after exactly one attempt (the first byte was out: no retry), and the stream ends."""
    a = Running(tmp_path / "a", "--model", str(tiny_model_dir))
    b = None
    try:
        invite = subprocess.run(
            mesh_command("invite", "--home", str(a.home), "--ttl", "10m"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert invite.returncode == 0, invite.stderr
        token = invite.stdout.strip().splitlines()[-1]
        b = Running(tmp_path / "b", "--no-worker", "--join", token)
        wait_for(lambda: "model" in _model_ids(b.url), 30, "A's model listed on B")
        with openai.OpenAI(base_url=a.url + "/v1", api_key="k", max_retries=0) as on_a:
            made = on_a.responses.create(model="model", input="x", max_output_tokens=2)

        body = {
            "model": "model",
            "messages": [{"role": "user", "content": "Go on forever."}],
            "temperature": 0,
            "max_tokens": 4000,  # random weights never stop early: far longer than this test
            "stream": True,
        }
        lines: list[str] = []
        killed_at = error_at = None
        with httpx.stream("POST", b.url + "/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            assert r.headers["x-route"] == "peer" and r.headers["x-attempts"] == "1"
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if killed_at is None and '"content"' in line:
                    killed_at = time.monotonic()
                    a.process.kill()  # reaped in ``finally``: B's pings must notice alone
                elif error_at is None and line.startswith('data: {"error"'):
                    error_at = time.monotonic()
        assert killed_at is not None, lines[-5:]
        assert error_at is not None, lines[-5:]  # the stream ended with an error, not silently
        assert lines[-1] == "data: [DONE]", lines[-5:]
        assert lines[-2].startswith('data: {"error"'), lines[-5:]
        assert error_at - killed_at < KILL_TO_ERROR_S, error_at - killed_at
        # A's stored responses are A's: with A gone they are unavailable (503), not unknown.
        on_b = openai.OpenAI(base_url=b.url + "/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.InternalServerError) as caught:
            on_b.responses.retrieve(made.id)
        assert caught.value.status_code == 503
        with pytest.raises(openai.InternalServerError):
            on_b.responses.create(model="model", input="z", previous_response_id=made.id)
    finally:
        if b is not None:
            print("---- node B ----\n" + b.stop())
        a.process.kill()
        print("---- node A ----\n" + a.output())
