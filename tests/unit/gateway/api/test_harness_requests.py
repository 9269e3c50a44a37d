"""Requests real agent harnesses sent (tests/fixtures/*_requests.json, captured from Claude Code
and OpenCode against the scripted gateway, trimmed) parse into what the model should see.

tests/e2e/test_claude_code.py and test_opencode.py run the clients themselves; these keep the
shapes covered where the binaries are not installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.api import chat, count_tokens, messages

FIXTURES = Path(__file__).parents[3] / "fixtures"
CLAUDE_CODE = json.loads((FIXTURES / "claude_code_requests.json").read_text())
OPENCODE = json.loads((FIXTURES / "opencode_requests.json").read_text())


def test_claude_code_tool_result_turn():
    body = CLAUDE_CODE["tool_result"]["body"]
    request, _ = messages.parse(body)
    system, user, assistant, tool = request.messages
    # The billing block (different every session) is left out; the prompt starts with the rest.
    assert system.role == "system" and system.content.startswith("You are a Claude agent")
    assert "x-anthropic-billing-header" not in system.content
    # The mid-conversation system message (the agent types) joins the user turn before it.
    assert user.role == "user"
    assert user.content.index("Run echo hi") < user.content.index("Available agent types")
    # Adaptive thinking is on; the thinking block Claude Code echoes back is the reasoning.
    assert request.reasoning is True
    assert assistant.reasoning and [c.name for c in assistant.tool_calls] == ["Bash"]
    assert tool.role == "tool" and tool.tool_call_id == assistant.tool_calls[0].id
    assert tool.content == "hi"
    assert len(request.tools) == 25 and "command" in request.tools[1].parameters["properties"]
    # metadata.user_id (device and session) keeps the session on one worker.
    assert request.session_key == body["metadata"]["user_id"]


def test_claude_code_title_request():
    body = CLAUDE_CODE["title"]["body"]
    assert body["output_config"]["format"]["type"] == "json_schema"
    request, _ = messages.parse(body)
    assert [m.role for m in request.messages] == ["system", "user"]
    assert request.tools == [] and request.session_key == body["metadata"]["user_id"]


@pytest.mark.parametrize("which", ["title", "tool_result"])
def test_claude_code_bodies_count(which: str):
    # count_tokens takes a Messages body; what only generating needs is left aside.
    request = count_tokens.parse(CLAUDE_CODE[which]["body"])
    assert count_tokens.estimate_tokens(request) > 10


def test_opencode_tool_result_turn():
    request, _ = chat.parse(OPENCODE["tool_result"]["body"])
    system, user, assistant, tool = request.messages
    assert system.role == "system" and system.content.startswith("You are opencode")
    assert user.role == "user"
    # The reasoning OpenCode echoes back (reasoning_content) stays with its turn.
    assert assistant.reasoning and [c.name for c in assistant.tool_calls] == ["bash"]
    assert tool.tool_call_id == assistant.tool_calls[0].id and tool.content == "hi\n"
    assert [t.name for t in request.tools][:1] == ["bash"] and request.tool_choice == "auto"


def test_opencode_title_request():
    request, _ = chat.parse(OPENCODE["title"]["body"])
    assert [m.role for m in request.messages] == ["system", "user", "user"]
    assert request.tools == []
