"""The Host/Origin guard: names the gateway is not served as get 421 (DNS rebinding), state-changing
requests from other sites' pages get 403, each in the API's error shape; clients pass."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.config import LOOPBACK_NAMES, GatewayConfig
from gateway.testing import ScriptedUpstream, ServerThread, asgi_request, text_script
from gateway.upstream import ModelInfo, StaticDirectory

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
MESSAGES = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}


def _app(**config: Any):
    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), ScriptedUpstream.of(*text_script("ok")))
    return create_app(directory, GatewayConfig(**config))


async def _chat(app, *headers: tuple[str, str]):
    return await asgi_request(app, "POST", "/v1/chat/completions", CHAT, headers=headers)


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1:9337",
        "localhost:9337",
        "LocalHost",
        "localhost.:9337",
        "[::1]:9337",
        "192.168.1.20:9337",  # an address: no name to rebind
        "[fe80::1]",
    ],
)
async def test_addresses_and_loopback_names_pass(host: str) -> None:
    assert (await _chat(_app(), ("host", host))).status == 200


async def test_a_request_without_host_passes() -> None:
    assert (await _chat(_app())).status == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:9337", "127.0.0.1.evil.example"])
async def test_other_names_are_421_in_each_shape(host: str) -> None:
    app = _app()
    refused = await _chat(app, ("host", host))
    assert refused.status == 421
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error" and host in error["message"]
    refused = await asgi_request(app, "POST", "/v1/messages", MESSAGES, headers=[("host", host)])
    assert refused.status == 421 and refused.json()["type"] == "error"
    # Reads too: a rebound page could read the answers.
    assert (await asgi_request(app, "GET", "/v1/models", headers=[("host", host)])).status == 421


async def test_configured_names_pass_and_star_accepts_any() -> None:
    app = _app(allowed_hosts=LOOPBACK_NAMES | {"mac-mini.local"})
    assert (await _chat(app, ("host", "mac-mini.local:9337"))).status == 200
    assert (await _chat(app, ("host", "Mac-Mini.Local"))).status == 200
    assert (await _chat(app, ("host", "other.local:9337"))).status == 421
    assert (
        await _chat(_app(allowed_hosts=frozenset({"*"})), ("host", "any.example"))
    ).status == 200


@pytest.mark.parametrize(
    "origin",
    [
        "http://127.0.0.1:9337",  # the gateway's own page (the console)
        "http://localhost:5173",  # a local tool
        "http://127.0.0.1:3000",
        "http://[::1]:8080",
    ],
)
async def test_posts_from_this_machines_pages_pass(origin: str) -> None:
    response = await _chat(_app(), ("host", "127.0.0.1:9337"), ("origin", origin))
    assert response.status == 200


@pytest.mark.parametrize(
    "origin",
    ["https://evil.example", "http://192.168.1.7:3000", "null", "file://", "http://[::1"],
)
async def test_posts_from_other_sites_pages_are_403_in_each_shape(origin: str) -> None:
    app = _app()
    headers = [("host", "127.0.0.1:9337"), ("origin", origin)]
    refused = await _chat(app, *headers)
    assert refused.status == 403
    assert refused.json()["error"]["type"] == "permission_error"
    refused = await asgi_request(app, "POST", "/v1/messages", MESSAGES, headers=headers)
    assert refused.status == 403
    assert refused.json()["error"] == {
        "type": "permission_error",
        "message": f"requests from pages of origin {origin!r} are refused",
    }
    # Reading is left to the browser's CORS rules (no CORS headers: it cannot read the answer).
    assert (await asgi_request(app, "GET", "/v1/models", headers=headers)).status == 200


async def test_the_origin_of_a_configured_name_passes() -> None:
    app = _app(allowed_hosts=LOOPBACK_NAMES | {"mac-mini.local"})
    headers = (("host", "127.0.0.1:9337"), ("origin", "http://mac-mini.local:8000"))
    assert (await _chat(app, *headers)).status == 200


def test_over_http_the_guard_keeps_the_connection() -> None:
    with ServerThread(_app()) as server, httpx.Client(base_url=server.url) as http:
        refused = http.post("/v1/chat/completions", json=CHAT, headers={"host": "evil.example"})
        assert refused.status_code == 421
        good = http.post("/v1/chat/completions", json=CHAT)
        assert good.status_code == 200
        port = "network_stream"
        assert good.extensions[port].get_extra_info("client_addr") == refused.extensions[
            port
        ].get_extra_info("client_addr")
