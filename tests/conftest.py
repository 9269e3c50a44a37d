"""Shared fixtures: tiny real MLX models built once per test session (see worker/testing.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.testing import THINK_SCRIPT, TOOL_SCRIPT, make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights, plain ChatML template: junk output that runs to max_tokens (greedy)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-plain") / "model")


@pytest.fixture(scope="session")
def tiny_think_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Think template (opens ``<think>\\n`` unless enable_thinking is false), scripted output:
    thinking on → reasoning "Let me think", content "The answer is 4."; off → content only."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-think") / "model", think=True, script=THINK_SCRIPT
    )


@pytest.fixture(scope="session")
def tiny_tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Plain template, scripted output: one ``get_weather({"city": "Paris"})`` tool call."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-tool") / "model", script=TOOL_SCRIPT)
