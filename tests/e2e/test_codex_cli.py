"""The real Codex CLI (npm ``@openai/codex``) against a gateway on loopback with a scripted model.

Codex runs ``codex exec`` with its default configuration apart from a custom model provider
pointing at the gateway (``wire_api = "responses"``). The scripted model's first answer is a
tool call, its second one text; the test checks that Codex ran the tool, handed its output back
in the next request, and printed the answer. The cases: a shell command with a model Codex has
no metadata for (its fallback tools: a namespace tool, web_search), an ``apply_patch`` custom
tool with a model it knows, and WebSocket mode (``supports_websockets = true``).

Needs the ``codex`` binary: ``make clients`` installs it into ``.cache/clients`` when npm is
there; ``CODEX_BIN`` or one on PATH also do. Without one the module is skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.testing import ScriptedUpstream, ServerThread, text_script
from gateway.upstream import ModelInfo, StaticDirectory

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[2]
KEY = "codex-test-key-0123456789"
MARK = "mesh-codex-ok"
ANSWER = f"The command printed {MARK}."
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello from the mesh\n*** End Patch\n"


def _codex_binary() -> Path | None:
    candidates = [
        os.environ.get("CODEX_BIN"),
        str(ROOT / ".cache" / "clients" / "node_modules" / ".bin" / "codex"),
        shutil.which("codex"),
    ]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


CODEX = _codex_binary()
if CODEX is None:
    pytest.skip(
        "no codex binary: run `make clients` (npm install --prefix .cache/clients @openai/codex) "
        "or set CODEX_BIN",
        allow_module_level=True,
    )


@dataclass
class Recorder:
    """A pure ASGI wrapper that keeps what Codex sent to /v1/responses (HTTP bodies and
    WebSocket messages, as JSON) and the HTTP response headers."""

    app: Callable
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    sockets: int = 0

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] != "/v1/responses":
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            self.sockets += 1
        chunks: list[bytes] = []

        async def recording_receive() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.bodies.append(json.loads(b"".join(chunks)))
            elif message["type"] == "websocket.receive" and message.get("text"):
                self.bodies.append(json.loads(message["text"]))
            return message

        async def recording_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.headers.append({k.decode(): v.decode() for k, v in message["headers"]})
            await send(message)

        await self.app(scope, recording_receive, recording_send)


@dataclass
class Session:
    result: subprocess.CompletedProcess[str]
    recorder: Recorder
    upstream: ScriptedUpstream
    workdir: Path

    @property
    def turns(self) -> list[dict[str, Any]]:
        """The requests that asked for an answer (not a WebSocket ``generate: false`` warmup)."""
        return [body for body in self.recorder.bodies if body.get("generate", True)]


def _run_codex(
    tmp_path: Path, model: str, call: tuple[str, str], *config: str, timeout: float = 60
) -> Session:
    upstream = ScriptedUpstream(
        scripts=[text_script("", reasoning="Run it.", tool_calls=[call]), text_script(ANSWER)]
    )
    directory = StaticDirectory()
    directory.add(ModelInfo(id=model), upstream)
    recorder = Recorder(create_app(directory, GatewayConfig(api_key=KEY, retry_backoff_ms=1)))
    home, workdir = tmp_path / "home", tmp_path / "work"
    (home / ".codex").mkdir(parents=True)
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env |= {"HOME": str(home), "CODEX_HOME": str(home / ".codex"), "MESH_API_KEY": KEY}
    with ServerThread(recorder) as server:
        (home / ".codex" / "config.toml").write_text(
            f'model = "{model}"\n'
            'model_provider = "mesh"\n\n'
            "[model_providers.mesh]\n"
            'name = "mlx-mesh"\n'
            f'base_url = "{server.url}/v1"\n'
            'wire_api = "responses"\n'
            'env_key = "MESH_API_KEY"\n' + "".join(f"{line}\n" for line in config)
        )
        result = subprocess.run(
            [
                str(CODEX),
                "exec",
                "--skip-git-repo-check",
                "--dangerously-bypass-approvals-and-sandbox",
                f"run `echo {MARK}` and tell me what it printed",
            ],
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    return Session(result, recorder, upstream, workdir)


def _outputs(body: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [item for item in body["input"] if item.get("type") == kind]


def _assert_completed(session: Session) -> None:
    result = session.result
    assert result.returncode == 0, f"codex failed:\n{result.stdout}\n{result.stderr}"
    assert ANSWER in result.stdout
    assert session.upstream.calls == 2 and len(session.turns) == 2


def test_codex_runs_a_shell_command_over_http(tmp_path):
    """The default: HTTP, and a model name Codex does not know (what a node serves)."""
    session = _run_codex(tmp_path, "smollm2-135m", ("exec_command", f'{{"cmd": "echo {MARK}"}}'))
    _assert_completed(session)
    first, second = session.turns
    assert first["store"] is False and first["include"] == ["reasoning.encrypted_content"]
    assert {"namespace", "web_search"} <= {tool["type"] for tool in first["tools"]}
    assert session.recorder.headers[0]["x-tools-ignored"] == "web_search"
    [output] = _outputs(second, "function_call_output")
    assert output["call_id"] == "call_0" and MARK in output["output"]
    # The reasoning came back encoded (store: false), and reached the model again.
    [reasoning] = _outputs(second, "reasoning")
    assert reasoning["encrypted_content"].startswith("mlxmesh-reasoning-v1.")
    assert session.upstream.requests[1].messages[-2].reasoning == "Run it."
    assert session.recorder.sockets == 0


def test_codex_applies_a_patch_through_its_custom_tool(tmp_path):
    """A model Codex knows gets its freeform ``apply_patch``: a custom_tool_call round trip."""
    arguments = json.dumps({"input": PATCH})
    session = _run_codex(tmp_path, "gpt-5.5", ("apply_patch", arguments))
    _assert_completed(session)
    first, second = session.turns
    assert any(t["type"] == "custom" and t["name"] == "apply_patch" for t in first["tools"])
    [call] = _outputs(second, "custom_tool_call")
    assert (call["name"], call["input"]) == ("apply_patch", PATCH)
    [output] = _outputs(second, "custom_tool_call_output")
    assert output["call_id"] == "call_0" and "hello.txt" in output["output"]
    assert (session.workdir / "hello.txt").read_text() == "hello from the mesh\n"


def test_codex_websocket_mode(tmp_path):
    """Opted in (``supports_websockets``): a warmup, then turns that send only new input."""
    call = ("exec_command", f'{{"cmd": "echo {MARK}"}}')
    session = _run_codex(tmp_path, "smollm2-135m", call, "supports_websockets = true")
    _assert_completed(session)
    assert session.recorder.sockets >= 1 and session.recorder.headers == []
    second = session.turns[1]
    assert second["previous_response_id"].startswith("resp_")
    [output] = _outputs(second, "function_call_output")
    assert MARK in output["output"]
