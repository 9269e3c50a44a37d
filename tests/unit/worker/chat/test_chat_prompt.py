"""The chat-template kwargs a request may not set are exactly the template call's own names."""

from __future__ import annotations

import inspect

import pytest
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from worker.chat.schemas import TEMPLATE_CALL_ARGUMENTS, ChatCompletionRequest


def test_every_parameter_of_apply_chat_template_is_reserved() -> None:
    # A transformers upgrade that adds a parameter must not let requests collide with it.
    signature = inspect.signature(PreTrainedTokenizerBase.apply_chat_template)
    named = {
        name
        for name, p in signature.parameters.items()
        if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    }
    assert named <= TEMPLATE_CALL_ARGUMENTS
    assert "messages" in TEMPLATE_CALL_ARGUMENTS  # what the template itself is rendered with


@pytest.mark.parametrize("key", sorted(TEMPLATE_CALL_ARGUMENTS))
def test_the_worker_refuses_each_reserved_key_by_name(key: str) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {key: 1}}
    with pytest.raises(ValidationError, match=repr(key)):
        ChatCompletionRequest.model_validate(body)


def test_template_variables_pass() -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "chat_template_kwargs": {"enable_thinking": False, "bos_token": "<s>", "x": [1]},
    }
    assert ChatCompletionRequest.model_validate(body).chat_template_kwargs is not None
