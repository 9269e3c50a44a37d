"""The generic tool prompt: probing a template, and tools/calls/results written as text."""

from __future__ import annotations

import json

import jinja2

from worker.testing import chat_template
from worker.tools.parsing import ToolCallSplitter
from worker.tools.prompt import generic_messages, renders_tools

# A ChatML template like SmolLM2's: no tools, no tool calls (it drops both silently).
_PLAIN = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _render(source: str):
    template = jinja2.Environment().from_string(source)

    def render(messages, tools):
        return template.render(messages=messages, tools=tools, add_generation_prompt=True)

    return render


def test_the_probe_tells_templates_that_render_tools_from_those_that_drop_them():
    assert renders_tools(_render(chat_template(think=False)))
    assert not renders_tools(_render(_PLAIN))

    def broken(messages, tools):
        raise jinja2.TemplateError("tools not supported")

    assert not renders_tools(broken)


def test_tools_calls_and_results_become_text_the_model_sees():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "22C"},
    ]
    text = _render(_PLAIN)(generic_messages(messages, [WEATHER]), None)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "get_weather"' in text and "Weather for a city" in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<|im_start|>user\n<tool_response>\n22C\n</tool_response>" in text


def test_the_format_it_teaches_is_the_one_the_parser_reads():
    """A model that answers as the generic prompt says produces a parsed tool call."""
    section = generic_messages([{"role": "user", "content": "x"}], [WEATHER])[0]["content"]
    example = section.split("\n")[3:6]  # the three lines of the example block
    assert example[0] == "<tool_call>" and example[2] == "</tool_call>"
    splitter = ToolCallSplitter()
    answer = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    pieces = splitter.feed(answer) + splitter.finish()
    calls = [value for kind, value in pieces if kind in ("tool_call", "tool_call_end")]
    assert [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}


def test_without_a_system_message_one_is_added():
    out = generic_messages([{"role": "user", "content": "x"}], [WEATHER])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("# Tools")
    assert generic_messages([{"role": "user", "content": "x"}], None) == [
        {"role": "user", "content": "x"}
    ]
