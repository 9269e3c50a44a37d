"""Agent-harness correctness: a 25-message coding-agent conversation (tools, tool results,
mid-conversation system messages) through /v1/messages, replayed turn by turn against the tiny
model; the worker's prompt cache must cover ≥ 90% of the prompt over turns 2..N."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import pytest

from gateway.api.messages import parse
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.events import Done, ToolCallDelta
from gateway.testing import ScriptedUpstream, ServerThread, gateway_over_worker
from gateway.upstream import ModelInfo, StaticDirectory

FIXTURE = json.loads(
    (Path(__file__).parents[1] / "fixtures" / "agent_conversation.json").read_text()
)


def _turn_prefixes() -> list[list[dict]]:
    """The history the harness sends before each assistant turn, and the final one."""
    messages = FIXTURE["messages"]
    prefixes = [messages[:i] for i, m in enumerate(messages) if m["role"] == "assistant"]
    return [*prefixes, messages]


def test_mid_conversation_system_messages_stay_in_place():
    request, _ = parse(
        {
            "model": "m",
            "max_tokens": 5,
            "system": FIXTURE["system"],
            "tools": FIXTURE["tools"],
            "messages": FIXTURE["messages"],
        }
    )
    roles = [m.role for m in request.messages]
    assert roles.count("system") == 1 and roles[0] == "system"  # only the leading prompt
    reminder = next(m for m in request.messages if "do not modify files outside" in m.content)
    assert reminder.role == "tool" and reminder.tool_call_id == "toolu_03"
    assert "do not modify" not in request.messages[0].content
    assert len(request.tools) == 3 and request.max_tokens == 5


def test_tool_not_offered_still_returns_as_tool_call():
    bogus = ScriptedUpstream.of(
        ToolCallDelta(0, id="c1", name="", arguments="{}"),
        ToolCallDelta(1, id="c2", name="x" * 300, arguments="{}"),
        Done("stop"),
    )
    directory = StaticDirectory()
    directory.add(ModelInfo(id="m"), bogus)
    with ServerThread(create_app(directory, GatewayConfig())) as server:
        client = anthropic.Anthropic(
            base_url=server.url, api_key="k", _strict_response_validation=True
        )
        message = client.messages.create(
            model="m",
            max_tokens=5,
            messages=[{"role": "user", "content": "x"}],
            tools=FIXTURE["tools"],
        )
        client.close()
    assert message.stop_reason == "tool_use"
    assert [b.name for b in message.content] == ["unknown", "x" * 200]


@pytest.fixture(scope="module")
def agent_gateway(tiny_model_dir):
    with gateway_over_worker(tiny_model_dir, "tiny") as front:
        yield front


def test_agent_replay_hits_prompt_cache(agent_gateway):
    client = anthropic.Anthropic(
        base_url=agent_gateway.url, api_key="k", _strict_response_validation=True
    )
    ratios = []
    for turn, history in enumerate(_turn_prefixes(), start=1):
        message = client.messages.create(
            model="tiny",
            max_tokens=2,
            system=FIXTURE["system"],
            tools=FIXTURE["tools"],
            messages=history,
        )
        assert message.stop_reason in ("max_tokens", "end_turn", "tool_use")
        usage = message.usage
        prompt = usage.input_tokens + usage.cache_read_input_tokens
        if turn > 1:
            ratios.append(usage.cache_read_input_tokens / prompt)
    client.close()
    print("cached/prompt over turns 2..N:", [round(r, 3) for r in ratios])
    assert len(ratios) == len(_turn_prefixes()) - 1 >= 10
    assert min(ratios) >= 0.9, ratios
    assert sum(ratios) / len(ratios) >= 0.9, ratios
