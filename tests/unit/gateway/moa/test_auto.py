"""``auto``'s rule as a pure function of the request."""

from __future__ import annotations

import pytest

from gateway.moa.auto import choose_policy
from gateway.request import ChatRequest, Message, OutputFormat, ToolCall, ToolSpec


def asking(text: str, **fields) -> ChatRequest:
    return ChatRequest(model="mesh", messages=[Message(role="user", content=text)], **fields)


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("What is 17 * 3? Answer with the number only.", "short-answer"),
        ("Capital of France? Reply with just one word.", "short-answer"),
        ("Solve it and put your final answer in \\boxed{}.", "short-answer"),
        ("Which is a mammal?\nA) shark\nB) whale\nC) trout", "choices"),
        ("Which is a mammal?\n(A) shark\n(B) whale", "choices"),
        ("What is 123 + 456?", "arithmetic"),
        ("Compute 7*(3-1)", "arithmetic"),
        ("What is 12 - 5?", "arithmetic"),
    ],
)
def test_short_answer_questions_get_one_answer_or_the_vote_when_configured(text, rule):
    assert choose_policy(asking(text)) == ("single", rule)
    assert choose_policy(asking(text), vote=True) == ("vote", rule)


@pytest.mark.parametrize(
    "text",
    [
        "Write me a poem about the sea.",
        "hi!",
        "Tell me about the history of Rome in 1200 words.",
        "Explain how a transformer works.",
        "Summarise the war of 1939-1945.",
        "Plan my week from 2024-01-05 on.",
    ],
)
def test_open_chat_races(text):
    assert choose_policy(asking(text)) == ("race", "open")


def test_agent_turns_race_even_when_the_question_is_short():
    short = "What is 2 + 2? Answer with the number only."
    assert choose_policy(asking(short, tools=[ToolSpec(name="calc")])) == ("race", "agent")
    call = ToolCall(id="1", name="calc", arguments="{}")
    history = [
        Message(role="user", content=short),
        Message(role="assistant", tool_calls=[call]),
        Message(role="tool", content="4", tool_call_id="1"),
    ]
    assert choose_policy(ChatRequest(model="mesh", messages=history)) == ("race", "agent")
    assert choose_policy(asking(short, max_tokens=4096)) == ("race", "long")
    assert choose_policy(asking(short, max_tokens=256)) == ("single", "short-answer")
    assert choose_policy(asking(short, output_format=OutputFormat())) == ("race", "structured")


def test_only_the_last_user_message_counts():
    messages = [
        Message(role="user", content="What is 2 + 2? Answer with the number only."),
        Message(role="assistant", content="4"),
        Message(role="user", content="Now write a story about it."),
    ]
    assert choose_policy(ChatRequest(model="mesh", messages=messages)) == ("race", "open")
