"""The real Claude Code (npm ``@anthropic-ai/claude-code``) against a gateway on loopback with a
scripted model, configured only as a user would point it at a node.

``claude -p`` runs a Bash tool round trip (the scripted model calls ``Bash``, Claude Code runs
it, hands the output back, the model answers), then ``claude -p --continue`` resumes that
session. On the way Claude Code also sends its side requests (the session title, with
``output_config.format``), and none of its requests may fail or be retried.

Needs the ``claude`` binary (see tests/agent_clients.py); without it the module skips.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from agent_clients import require_client, run_client, scripted_gateway

from gateway.events import Error, Event
from gateway.request import ChatRequest
from gateway.testing import ToolRoundTrip
from worker.chat.job import context_overflow

pytestmark = pytest.mark.e2e

CLAUDE = require_client("claude", "@anthropic-ai/claude-code")
MODEL = "smollm2-135m"
KEY = "claude-test-key-0123456789"
MARK = "mesh-claude-ok"
ANSWER = f"The command printed {MARK}."


def _environment(url: str) -> dict[str, str]:
    """What docs/agents.md tells a user to set, plus the switches that keep a test run off the
    internet (telemetry, error reports, the self-updater); none of them changes the requests."""
    return {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": KEY,
        "ANTHROPIC_MODEL": MODEL,
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
    }


def _bash_model() -> dict:
    return {
        "tool": "Bash",
        "arguments": {"command": f"echo {MARK}", "description": "Print the mark"},
        "answer": ANSWER,
        "side_answer": '{"title": "Print the mark"}',
        "reasoning": "The user wants the command run.",
    }


def _claude(tmp_path: Path, env: dict[str, str], *args: str):
    """``claude -p ARGS --allowedTools Bash`` in ``tmp_path``'s project with its HOME (one HOME
    per test, so ``--continue`` finds the session before). -p asks nobody: a tool that is not
    allowed is refused."""
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    command = [CLAUDE, "-p", *args, "--allowedTools", "Bash"]
    return run_client(command, home=tmp_path / "home", cwd=project, env=env)


def test_bash_round_trip_then_continue(tmp_path: Path):
    model = ToolRoundTrip(**_bash_model())
    with scripted_gateway(model, MODEL, tmp_path, api_key=KEY) as gateway:
        env = _environment(gateway.url)
        first = _claude(tmp_path, env, "Run the echo command.")
        first_calls = len(model.requests)
        second = _claude(tmp_path, env, "--continue", "Run it once more.")

    assert first.returncode == 0, first.stdout + first.stderr
    assert ANSWER in first.stdout
    assert second.returncode == 0, second.stdout + second.stderr
    assert ANSWER in second.stdout

    # The call reached Claude Code, which ran it and sent its output back as a tool_result.
    results = list(model.tool_results().values())
    assert len(results) == 2 and all(r.strip() == MARK for r in results)

    # Each run: one request with the tools that gets the call, one with its result; a retry
    # would show as one more. The rest are side requests without tools (the title).
    main = [r for r in model.requests if r.tools]
    assert len(main) == 4, [len(r.messages) for r in main]
    exchanges = [e for e in gateway.recorder.exchanges if e.path == "/v1/messages"]
    assert {e.headers.get("x-stainless-retry-count") for e in exchanges} == {"0"}
    bodies = [e.body for e in exchanges]
    assert any("format" in (b.get("output_config") or {}) for b in bodies)  # the title

    # --continue: the second run's first request carries the first run's whole turn.
    resumed = next(r for r in model.requests[first_calls:] if r.tools)
    history = [(m.role, m.content) for m in resumed.messages]
    assert ("tool", MARK) in [(role, content.strip()) for role, content in history]
    assert ("assistant", ANSWER) in history
    assert resumed.messages[-1].content.endswith("Run it once more.")
    # One session on one worker: every request keys on the same metadata.user_id.
    assert len({r.session_key for r in model.requests}) == 1

    # The billing header block is gone from the system prompt; Claude Code's own text stays.
    assert "x-anthropic-billing-header" not in main[0].messages[0].content
    assert "Claude" in main[0].messages[0].content

    assert gateway.failures() == []


@dataclass
class OutgrownOnce(ToolRoundTrip):
    """Refuses the first request that resumes the session the way a worker refuses a prompt
    longer than its model's context (worker.chat.job.context_overflow)."""

    refused: int = 0

    async def stream(self, request: ChatRequest) -> AsyncIterator[Event]:
        resuming = any(m.role == "assistant" and m.content == ANSWER for m in request.messages)
        if request.tools and resuming and not self.refused:
            self.refused += 1
            self.requests.append(request)
            overflow = context_overflow(30_000, 8_192)
            yield Error(kind="invalid_request", message=str(overflow), code=overflow.code)
            return
        async for event in super().stream(request):
            yield event


def test_a_session_past_the_context_is_compacted_and_goes_on(tmp_path: Path):
    # Claude Code knows nothing of a node model's context (it assumes Claude's), so it never
    # compacts ahead; the worker's 400 in Anthropic's words makes it compact and go on.
    model = OutgrownOnce(**_bash_model())
    with scripted_gateway(model, MODEL, tmp_path, api_key=KEY) as gateway:
        env = _environment(gateway.url)
        first = _claude(tmp_path, env, "Run the echo command.")
        second = _claude(tmp_path, env, "--continue", "Run it once more.")

    assert first.returncode == 0, first.stdout + first.stderr
    assert second.returncode == 0, second.stdout + second.stderr
    assert ANSWER in second.stdout
    assert model.refused == 1
    # The refusal, then one request for a summary of the conversation, then the turn itself.
    summaries = [
        r for r in model.requests if "summary of the conversation" in r.messages[-1].content
    ]
    assert len(summaries) == 1
    assert gateway.failures() == ["POST /v1/messages → 400", "log: messages 400 invalid_request"]


def test_a_model_picked_by_alias_is_the_node_model_the_environment_names(tmp_path: Path):
    """`--model haiku` (also a subagent's `model: haiku`) asks for Anthropic's model name, which
    no node serves; ANTHROPIC_DEFAULT_HAIKU_MODEL (docs/agents.md) maps the alias to a node
    model."""
    model = ToolRoundTrip(**_bash_model())
    with scripted_gateway(model, MODEL, tmp_path, api_key=KEY) as gateway:
        env = _environment(gateway.url)
        env.pop("ANTHROPIC_MODEL")
        env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] = MODEL
        run = _claude(tmp_path, env, "--model", "haiku", "Run the echo command.")
    assert run.returncode == 0, run.stdout + run.stderr
    assert ANSWER in run.stdout
    exchanges = [e for e in gateway.recorder.exchanges if e.path == "/v1/messages"]
    assert exchanges and {e.body["model"] for e in exchanges} == {MODEL}
    assert gateway.failures() == []
