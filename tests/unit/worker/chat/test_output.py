"""Stop strings, tool-call parsing and delta assembly: the worker's pure text pipeline."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.chat.output import DeltaAssembler
from worker.sampling import StopMatcher
from worker.tools.parsing import MAX_TOOL_NAME, ToolCallSplitter, clamp_tool_name


def run_stop(chunks: list[str], stops: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out = []
    for chunk in chunks:
        text, stopped = matcher.feed(chunk)
        out.append(text)
        if stopped:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


def test_stop_string_split_across_tokens_is_not_emitted() -> None:
    assert run_stop(["Hello wo", "r", "ld and more"], ["world"]) == ("Hello ", True)


def test_stop_earliest_of_several() -> None:
    assert run_stop(["a STOP b END"], ["END", "STOP"]) == ("a ", True)


def test_matched_stop_is_reported() -> None:
    matcher = StopMatcher(["END", "STOP"])
    assert matcher.feed("a ST") == ("a ", False)
    assert matcher.matched is None
    assert matcher.feed("OP b END") == ("", True)
    assert matcher.matched == "STOP"
    # At the same position the longer stop is the one that matched the text.
    tie = StopMatcher(["ab", "abc"])
    assert tie.feed("xabcd") == ("x", True)
    assert tie.matched == "abc"
    assert StopMatcher(["zz"]).matched is None


def test_partial_stop_released_when_it_does_not_complete() -> None:
    assert run_stop(["abc wor", "m"], ["world"]) == ("abc worm", False)
    assert run_stop(["abc wor"], ["world"]) == ("abc wor", False)


def test_no_stops_passes_through() -> None:
    assert run_stop(["x", "y"], []) == ("xy", False)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abXY", max_size=40),
    stop=st.text(alphabet="abXY", min_size=1, max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=10),
)
def test_stop_matching_is_chunking_invariant(text: str, stop: str, cuts: list[int]) -> None:
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    expected = (text[: text.find(stop)], True) if stop in text else (text, False)
    assert run_stop(chunks, [stop]) == expected


def split_tools(chunks: list[str]) -> list[tuple[str, object]]:
    splitter = ToolCallSplitter()
    pieces = []
    for chunk in chunks:
        pieces.extend(splitter.feed(chunk))
    pieces.extend(splitter.finish())
    return pieces


def whole_calls(pieces: list[tuple[str, object]]) -> list:
    return [v for k, v in pieces if k in ("tool_call", "tool_call_end")]


def test_tool_call_across_chunks_streams_its_arguments() -> None:
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    cuts = ["Sure. <tool", "_call>\n", call[:10], call[10:40], call[40:], "\n</tool", "_call>"]
    pieces = split_tools(cuts)
    assert pieces[0] == ("content", "Sure. ")
    kinds = [k for k, _ in pieces[1:]]
    assert kinds == ["tool_call_start", "tool_call_args", "tool_call_args", "tool_call_end"]
    call_id, name = pieces[1][1]
    assert name == "get_weather" and call_id.startswith("call_")
    streamed = "".join(v for k, v in pieces if k == "tool_call_args")
    assert streamed == '{"city": "Paris"}'
    (parsed,) = whole_calls(pieces)
    assert (parsed.id, parsed.name, parsed.arguments) == (call_id, "get_weather", streamed)


@settings(max_examples=200, deadline=None)
@given(
    arguments=st.dictionaries(
        st.text(alphabet='ab{}[]"\\: ', max_size=4),
        st.one_of(st.text(alphabet='x{}"\\', max_size=4), st.integers(), st.lists(st.none())),
        max_size=3,
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12),
)
def test_streamed_arguments_are_chunking_invariant(arguments: dict, cuts: list[int]) -> None:
    args = json.dumps(arguments)
    text = f'ok <tool_call>{{"name": "f", "arguments": {args}}}</tool_call> done'
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    pieces = split_tools(chunks)
    assert next(v for k, v in pieces if k == "tool_call_start")[1] == "f"
    assert "".join(v for k, v in pieces if k == "tool_call_args") == args
    (call,) = whole_calls(pieces)
    assert json.loads(call.arguments) == arguments
    # (Whitespace right after the end tag is trimmed only when it arrives with the tag.)
    assert "".join(v for k, v in pieces if k == "content").split() == ["ok", "done"]


def test_cut_off_arguments_keep_the_started_call() -> None:
    pieces = split_tools(['<tool_call>{"name": "a", "arguments": {"x": [1, ', "2"])
    kinds = [k for k, _ in pieces]
    assert kinds == ["tool_call_start", "tool_call_args", "tool_call_args", "tool_call_end"]
    (call,) = whole_calls(pieces)
    assert (call.name, call.arguments) == ("a", '{"x": [1, 2')


def test_two_calls_and_string_arguments() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    pieces = split_tools([text])
    calls = whole_calls(pieces)
    assert [c.name for c in calls] == ["a", "b"]
    # String arguments come whole; the object ones stream.
    assert [k for k, _ in pieces][:2] == ["tool_call", "tool_call_start"]
    assert json.loads(calls[0].arguments) == {"x": 1}


def test_unparseable_call_is_kept_as_content() -> None:
    assert split_tools(["<tool_call>not json</tool_call>"]) == [
        ("content", "<tool_call>not json</tool_call>")
    ]


def test_cut_off_call_is_kept_as_content() -> None:
    assert split_tools(['<tool_call>{"name": "a"']) == [("content", '<tool_call>{"name": "a"')]


def test_tool_names_clamped() -> None:
    assert clamp_tool_name("") == "unknown"
    assert clamp_tool_name("   ") == "unknown"
    assert clamp_tool_name(None) == "unknown"
    assert clamp_tool_name("x" * 500) == "x" * MAX_TOOL_NAME
    calls = whole_calls(split_tools(['<tool_call>{"name": "", "arguments": {}}</tool_call>']))
    assert calls[0].name == "unknown"


def test_custom_parser_from_mlx_lm() -> None:
    from mlx_lm.tool_parsers import qwen3_coder

    splitter = ToolCallSplitter(
        start=qwen3_coder.tool_call_start,
        end=qwen3_coder.tool_call_end,
        parser=qwen3_coder.parse_tool_call,
    )
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    pieces = splitter.feed(text) + splitter.finish()
    assert pieces[0][0] == "tool_call"
    assert pieces[0][1].name == "get_weather"
    assert json.loads(pieces[0][1].arguments) == {"city": "Paris"}


def test_assembler_think_then_tool_call() -> None:
    asm = DeltaAssembler(
        think_tags=("<think>", "</think>"), in_reasoning=True, tool_splitter=ToolCallSplitter()
    )
    deltas = []
    for chunk in [
        "plan",
        "</think>\n",
        "<tool_call>",
        '{"name": "f", "arguments": {}}',
        "</tool_call>",
    ]:
        deltas.extend(asm.feed(chunk))
    deltas.extend(asm.finish())
    assert deltas[0] == {"reasoning_content": "plan"}
    assert deltas[1]["tool_calls"][0]["function"]["name"] == "f"
    assert deltas[1]["tool_calls"][0]["index"] == 0
    assert deltas[1]["tool_calls"][0]["function"]["arguments"] == ""
    # Later fragments carry only the index and arguments text (OpenAI's streaming shape).
    assert deltas[2] == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    message = asm.message()
    assert message["reasoning_content"] == "plan"
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}


def test_assembler_without_tools_keeps_tags_as_content() -> None:
    asm = DeltaAssembler(think_tags=None, in_reasoning=False, tool_splitter=None)
    asm.feed("<tool_call>x</tool_call>")
    asm.finish()
    assert asm.message() == {"role": "assistant", "content": "<tool_call>x</tool_call>"}
