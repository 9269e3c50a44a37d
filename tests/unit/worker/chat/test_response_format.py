"""What a ``response_format`` changes about a worker job: the grammar, its 400s, the think block."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from worker.chat.response_format import (
    OutputFormatError,
    agrammar_processor,
    answer_prompt,
    output_grammar,
)
from worker.chat.schemas import ResponseFormat

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}


def _format(**fields: object) -> ResponseFormat:
    return ResponseFormat.model_validate(fields)


def test_text_or_no_format_is_free_text() -> None:
    assert output_grammar(None, tools_offered=True) is None
    assert output_grammar(_format(type="text"), tools_offered=True) is None


def test_json_schema_and_json_object_give_grammars() -> None:
    by_schema = output_grammar(
        _format(type="json_schema", json_schema={"name": "t", "schema": SCHEMA, "strict": True}),
        tools_offered=False,
    )
    assert by_schema and by_schema != output_grammar(_format(type="json_object"), False)
    # json_object ignores a json_schema sent along with it
    assert output_grammar(
        _format(type="json_object", json_schema={"schema": SCHEMA}), False
    ) == output_grammar(_format(type="json_object"), False)


@pytest.mark.parametrize(
    ("fields", "tools", "param"),
    [
        ({"type": "json_object"}, True, "tools"),
        (
            {"type": "json_schema", "json_schema": {"schema": {"type": "array", "contains": {}}}},
            False,
            "response_format.json_schema.schema.contains",
        ),
    ],
)
def test_what_cannot_be_served_names_the_field(
    fields: dict[str, object], tools: bool, param: str
) -> None:
    with pytest.raises(OutputFormatError) as info:
        output_grammar(_format(**fields), tools_offered=tools)
    assert info.value.param == param and str(info.value).startswith(param + ": ")


def test_a_think_block_the_template_left_open_is_closed(tiny_think_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_think_model_dir)
    prompt = tok.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    assert answer_prompt(tok, prompt, in_reasoning=False) == prompt
    closed = answer_prompt(tok, prompt, in_reasoning=True)
    assert tok.decode(closed).endswith("<think>\n</think>\n\n")


class _SlowTokenizerModel:
    """A model whose tokenizer is not a fast HF one: llguidance cannot read it."""

    _tokenizer = object()
    eos_token_ids = frozenset({0})


async def test_a_tokenizer_llguidance_cannot_read_is_a_400_naming_response_format() -> None:
    with pytest.raises(OutputFormatError) as info:
        await agrammar_processor(
            _SlowTokenizerModel(), output_grammar(_format(type="json_object"), False)
        )
    assert info.value.param == "response_format" and "tokenizer" in str(info.value)
