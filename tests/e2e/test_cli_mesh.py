"""``mesh id``, ``mesh invite`` and ``mesh status`` against a gateway on loopback serving the
mesh endpoints' shapes (the endpoints themselves are tested in test_mesh_service.py)."""

from __future__ import annotations

import os

import orjson
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from typer.testing import CliRunner

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.testing import ServerThread
from gateway.upstream import StaticDirectory
from mesh.cli import app
from mesh.membership.invite import make_invite

runner = CliRunner()
STATUS = {
    "node": {
        "node_id": "a" * 64,
        "mesh_id": "m1",
        "members": 2,
        "models": [{"name": "tiny"}],
        "queue_depth": 0,
        "in_flight": 1,
    },
    "peers": [
        {
            "node_id": "b" * 64,
            "state": "up",
            "connected": True,
            "addresses": ["10.0.0.2:9338"],
            "models": [{"name": "big"}],
            "queue_depth": 2,
            "in_flight": 1,
            "tok_s": 31.5,
            "rtt_ms": 1.25,
            "last_seen_s": 0.4,
        },
    ],
}
TOKEN = make_invite(mesh_id="m1", inviter="a" * 64, fingerprint="f", addresses=["h:1"], now=0.0)


@pytest.fixture
def node(tmp_path):
    seen: list[dict] = []

    async def invite(request: Request) -> JSONResponse:
        seen.append(orjson.loads(await request.body()))
        return JSONResponse({"token": TOKEN.encode(), "expires_at": 4e9})

    routes = [Route("/api/mesh/invite", invite, methods=["POST"])]
    config = GatewayConfig(api_key="secret")
    app = create_app(StaticDirectory(), config, extra_routes=routes, status=lambda: STATUS)
    with ServerThread(app) as server:
        info = {"url": server.url, "pid": os.getpid(), "api_key": "secret"}
        (tmp_path / "node.json").write_bytes(orjson.dumps(info))
        yield tmp_path, seen


def test_invite_prints_the_token_alone_on_the_last_line(node):
    home, seen = node
    result = runner.invoke(app, ["invite", "--home", str(home), "--ttl", "15m"])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == TOKEN.encode()
    assert seen == [{"ttl_s": 900.0}]  # the API key from node.json got it past the guard


def test_invite_bad_ttl_is_one_sentence(node):
    home, _ = node
    result = runner.invoke(app, ["invite", "--home", str(home), "--ttl", "soon"])
    assert result.exit_code == 1 and "bad ttl" in result.output


def test_status_table_and_json(node):
    home, _ = node
    table = runner.invoke(app, ["status", "--home", str(home)], env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    assert "bbbbbbbbbbbbbbbb" in table.output and "10.0.0.2:9338" in table.output
    assert "big" in table.output and "1.2" in table.output  # RTT column
    raw = runner.invoke(app, ["status", "--home", str(home), "--json"])
    assert orjson.loads(raw.output) == STATUS


def test_commands_without_a_running_node_fail_cleanly(tmp_path):
    result = runner.invoke(app, ["status", "--home", str(tmp_path)])
    assert result.exit_code == 1 and "no node is running" in " ".join(result.output.split())


def test_up_refuses_an_unknown_moa_policy_in_one_sentence(tmp_path):
    result = runner.invoke(app, ["up", "--home", str(tmp_path), "--moa-policy", "bogus"])
    assert result.exit_code == 1
    assert "unknown --moa-policy 'bogus'" in " ".join(result.output.split())


@pytest.mark.parametrize(("flag", "progress"), [([], False), (["--moa-progress"], True)])
def test_up_wires_moa_progress_into_the_node_config(tmp_path, monkeypatch, flag, progress):
    started = []
    monkeypatch.setattr("mesh.node.run_mesh_node", lambda config, mesh: started.append(config))
    result = runner.invoke(app, ["up", "--home", str(tmp_path), "--no-worker", *flag])
    assert result.exit_code == 0, result.output
    assert started[0].moa.progress is progress


def test_id_creates_and_keeps_the_identity(tmp_path):
    first = runner.invoke(app, ["id", "--home", str(tmp_path)])
    second = runner.invoke(app, ["id", "--home", str(tmp_path)])
    assert first.exit_code == 0, first.output
    node_id = first.output.strip().splitlines()[-1]
    assert len(node_id) == 64 and second.output.strip().splitlines()[-1] == node_id
    assert "mesh: (none yet)" in first.output


class _StubService:
    def __init__(self) -> None:
        self.removed: list[str] = []

    def status(self) -> dict:
        return STATUS

    def create_invite(self, ttl_s: float):
        return TOKEN

    def member_rows(self) -> list[dict]:
        return [
            {"node_id": "a" * 64, "addresses": ["10.0.0.1:9338"], "self": True},
            {"node_id": "b" * 64, "addresses": ["10.0.0.2:9338"], "connected": True},
        ]

    def removed_rows(self) -> list[dict]:
        return [{"node_id": "c" * 64, "removed_by": "a" * 64, "removed_at": 1.7e9}]

    def remove_member(self, node: str, keep=(), dry_run: bool = False):
        from mesh.errors import MembershipError
        from mesh.roster import RemovalReport

        if not ("b" * 64).startswith(node):
            raise MembershipError(f"no member {node!r} in mesh m1")
        if not dry_run:
            self.removed.append("b" * 64)
        return RemovalReport("b" * 64, going_with=["d" * 64])


def test_members_list_and_remove_through_the_running_node(tmp_path):
    from mesh.http import mesh_routes

    service = _StubService()
    routes = mesh_routes(service, api_key=None, csrf_token="t0ken")
    with ServerThread(create_app(StaticDirectory(), extra_routes=routes)) as server:
        info = {"url": server.url, "pid": os.getpid(), "csrf": "t0ken"}
        (tmp_path / "node.json").write_bytes(orjson.dumps(info))
        listed = runner.invoke(app, ["members", "list", "--home", str(tmp_path)])
        assert listed.exit_code == 0, listed.output
        assert "this node" in listed.output and "linked" in listed.output
        assert "removed" in listed.output and "cccccccccccccccc" in listed.output
        asked = ["members", "remove", "bbbb", "--home", str(tmp_path)]
        dry = runner.invoke(app, [*asked, "--dry-run"])
        assert dry.exit_code == 0 and "would remove" in dry.output and "dddddddddddd" in dry.output
        assert service.removed == []
        removed = runner.invoke(app, asked)
        assert removed.exit_code == 0, removed.output
        assert service.removed == ["b" * 64] and "removed" in removed.output
        assert "with it" in removed.output
        unknown = runner.invoke(app, ["members", "remove", "cccc", "--home", str(tmp_path)])
        assert unknown.exit_code == 1 and "no member 'cccc'" in unknown.output


@pytest.mark.parametrize(
    ("client", "api_key", "status"),
    [
        ("127.0.0.1", None, 200),
        ("10.0.0.5", None, 403),  # no key: minting invites is for this machine only
        ("10.0.0.5", "k", 200),  # with a key the guard already checked it
    ],
)
async def test_invite_endpoint_is_loopback_only_without_a_key(client, api_key, status):
    import httpx

    from mesh.http import mesh_routes

    routes = mesh_routes(_StubService(), api_key=api_key, csrf_token="t0ken")
    app = create_app(StaticDirectory(), GatewayConfig(api_key=api_key), extra_routes=routes)
    transport = httpx.ASGITransport(app=app, client=(client, 1234))
    headers = {"authorization": "Bearer k"} if api_key else {"x-mesh-csrf": "t0ken"}
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        response = await http.post("/api/mesh/invite", json={}, headers=headers)
    assert response.status_code == status
    if status == 200:
        assert response.json()["token"] == TOKEN.encode()


@pytest.mark.parametrize(
    ("content_type", "csrf", "status"),
    [
        ("text/plain", "t0ken", 415),  # a cross-site form or fetch without preflight
        ("application/json", None, 403),  # a page that cannot read the node's token
        ("application/json", "wrong", 403),
        ("application/json", "t0ken", 200),
    ],
)
async def test_admin_posts_need_json_and_the_csrf_token_without_a_key(content_type, csrf, status):
    import httpx

    from mesh.http import mesh_routes

    routes = mesh_routes(_StubService(), api_key=None, csrf_token="t0ken")
    app = create_app(StaticDirectory(), GatewayConfig(), extra_routes=routes)
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 1234))
    headers = {"content-type": content_type} | ({"x-mesh-csrf": csrf} if csrf else {})
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        response = await http.post("/api/mesh/invite", content=b"{}", headers=headers)
        assert response.status_code == status
        token = (await http.get("/api/mesh/csrf")).json()["token"]
    assert token == "t0ken"


def test_up_reads_secrets_from_a_file_or_stdin_and_lists_allowed_hosts(tmp_path, monkeypatch):
    """--api-key @FILE / --join - keep secrets out of the process list; Host names are derived."""
    started: list = []
    monkeypatch.setattr(
        "mesh.node.run_mesh_node", lambda config, mesh: started.append((config, mesh))
    )
    key_file = tmp_path / "key"
    key_file.write_text("a-long-enough-api-key\n")
    result = runner.invoke(
        app,
        ["up", "--no-worker", "--home", str(tmp_path / "h"), "--api-key", f"@{key_file}",
         "--join", "-", "--advertise", "mac-mini.lan:9338", "--allowed-host", "Gateway.Example"],
        input="mlxmesh1.token-from-stdin\n",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    ((config, mesh),) = started
    assert config.gateway.api_key == "a-long-enough-api-key"
    assert mesh.join_token == "mlxmesh1.token-from-stdin"
    hosts = config.gateway.allowed_hosts
    assert {"localhost", "mac-mini.lan", "gateway.example"} <= hosts
    assert not any(":" in h for h in hosts)


def test_up_refuses_a_key_file_it_cannot_read(tmp_path):
    result = runner.invoke(app, ["up", "--no-worker", "--api-key", f"@{tmp_path / 'missing'}"])
    assert result.exit_code == 1 and "cannot read the API key" in result.output


def test_up_with_a_fresh_home_serves_the_default_stores_copy_in_one_line(tmp_path, monkeypatch):
    """`mesh up --home DIR --model smollm2-135m` on a fresh DIR: the model sits in the default
    store ($MLX_MESH_HOME here), so the node serves that copy and says so, instead of failing
    with "not in DIR/models"."""
    default = tmp_path / "default"
    stored = default / "models" / "smollm2-135m"
    stored.mkdir(parents=True)
    monkeypatch.setenv("MLX_MESH_HOME", str(default))
    started: list = []
    monkeypatch.setattr("mesh.node.run_mesh_node", lambda config, mesh: started.append(config))
    result = runner.invoke(
        app, ["up", "--home", str(tmp_path / "fresh"), "--model", "smollm2-135m"]
    )
    assert result.exit_code == 0, result.output
    assert started[0].models == (str(stored),)
    assert f"serving {stored}" in " ".join(result.output.split())
