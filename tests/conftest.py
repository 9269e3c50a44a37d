"""Shared fixtures: tiny real MLX models built once per test session (see worker/testing.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from worker.testing import THINK_SCRIPT, TOOL_SCRIPT, make_tiny_model

# CI (CI=true) replays the same examples every run, so a red CI is reproducible and never a
# roll of the dice; runs on a developer's machine keep exploring new inputs and find new bugs.
# No per-example deadline in CI either: a shared 2-core runner's timing is not behaviour.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# Random-weight models loop under greedy decoding, and many tests need a stream that goes on
# (cancels, kills, disconnects): no loop guard in this process and the nodes it starts. The
# guard's own tests set EngineConfig.loop_guard_tokens.
os.environ["MLX_MESH_LOOP_GUARD"] = "0"

# pytest-xdist workers start with COLUMNS=80 and LINES=24 in their environment (a plain run has
# none). rich fixes a console's width from COLUMNS when it is made, at the CLI's import, so a CLI
# test's own COLUMNS (CliRunner's env=) would be ignored and wide tables fold. Without them rich
# reads COLUMNS at each print, as in a plain run.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights, plain ChatML template: junk output that runs to max_tokens (greedy)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-plain") / "model")


@pytest.fixture(scope="session")
def sliding_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights with a sliding-window layer (window 8, shorter than the prefill chunks the
    engine tests use): its RotatingKVCache wraps during a prefill."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-sliding") / "model", sliding_window=8)


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


_E2E_DIR = Path(__file__).parent / "e2e"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/e2e/ (loopback servers, processes, the browser) is marked ``e2e``,
    so the fast loop runs alone: ``pytest -m "not e2e"`` (``make unit``)."""
    for item in items:
        if _E2E_DIR in item.path.parents:
            item.add_marker(pytest.mark.e2e)
