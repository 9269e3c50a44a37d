"""The real OpenCode (npm ``opencode-ai``) against a gateway on loopback with a scripted model,
configured only as a user would point it at a node: an ``opencode.json`` with one custom
provider (``@ai-sdk/openai-compatible``, which speaks Chat Completions).

``opencode run`` runs a ``bash`` tool round trip (the scripted model calls ``bash``, OpenCode
runs it, hands the output back as a tool message, the model answers), then
``opencode run --continue`` resumes that session. On the way OpenCode also asks for a session
title (a request without tools), and none of its requests may fail or be retried.

Needs the ``opencode`` binary (see tests/agent_clients.py); without it the module skips.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from agent_clients import require_client, run_client, scripted_gateway

from gateway.testing import ToolRoundTrip

pytestmark = pytest.mark.e2e

OPENCODE = require_client("opencode", "opencode-ai")
MODEL = "smollm2-135m"
KEY = "opencode-test-key-0123456789"
MARK = "mesh-opencode-ok"
ANSWER = f"The command printed {MARK}."


def opencode_config(url: str) -> dict:
    """The opencode.json of docs/agents.md."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "mesh": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "mlx-mesh",
                "options": {"baseURL": f"{url}/v1", "apiKey": KEY},
                "models": {MODEL: {"name": MODEL}},
            }
        },
        "model": f"mesh/{MODEL}",
    }


# OpenCode fetches the models.dev catalogue at start: offline that fails (logged, harmless, about
# two seconds); this keeps a test run off the internet. Nothing it would say is about our model.
ENVIRONMENT = {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1"}


def test_bash_round_trip_then_continue(tmp_path: Path):
    model = ToolRoundTrip(
        tool="bash",
        arguments={"command": f"echo {MARK}", "description": "Print the mark"},
        answer=ANSWER,
        side_answer="Print the mark",
        reasoning="The user wants the command run.",
    )
    project = tmp_path / "project"
    project.mkdir()
    home = tmp_path / "home"
    with scripted_gateway(model, MODEL, tmp_path, api_key=KEY) as gateway:
        (project / "opencode.json").write_bytes(orjson.dumps(opencode_config(gateway.url)))
        run = [OPENCODE, "run"]
        first = run_client([*run, "Run the echo command."], home=home, cwd=project, env=ENVIRONMENT)
        first_calls = len(model.requests)
        second = run_client(
            [*run, "--continue", "once more"], home=home, cwd=project, env=ENVIRONMENT
        )

    assert first.returncode == 0, first.stdout + first.stderr
    assert ANSWER in first.stdout
    assert second.returncode == 0, second.stdout + second.stderr
    assert ANSWER in second.stdout

    # The call reached OpenCode, which ran it and sent its output back as a tool message.
    results = list(model.tool_results().values())
    assert len(results) == 2 and all(r.strip() == MARK for r in results)

    # Each run: one request with the tools that gets the call, one with its result; a retry
    # (the AI SDK retries 429 and 5xx) would show as one more. The title asks without tools.
    main = [r for r in model.requests if r.tools]
    assert len(main) == 4, [len(r.messages) for r in main]
    assert len(model.requests) - len(main) >= 1
    exchanges = gateway.recorder.exchanges
    assert {e.path for e in exchanges} == {"/v1/chat/completions"}

    # --continue: the second run's first request carries the first run's whole turn, and
    # the reasoning OpenCode echoed back (reasoning_content) came through.
    resumed = next(r for r in model.requests[first_calls:] if r.tools)
    history = [(m.role, m.content.strip()) for m in resumed.messages]
    assert ("tool", MARK) in history and ("assistant", ANSWER) in history
    assert any(m.reasoning for m in resumed.messages if m.role == "assistant")
    assert "once more" in resumed.messages[-1].content  # OpenCode quotes words with spaces
    # One session on one worker: OpenCode names it in x-session-affinity on every request.
    sessions = {e.headers.get("x-session-affinity") for e in exchanges}
    assert len(sessions) == 1 and None not in sessions
    assert {r.session_key for r in model.requests} == sessions

    assert gateway.failures() == []
