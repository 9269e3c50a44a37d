"""Fixtures the worker's unit tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.engine.core import Engine


@pytest.fixture
def fresh_engine(tiny_model_dir: Path) -> Iterator[Engine]:
    """A started engine on the tiny model, this test's own (its prompt cache starts empty)."""
    engine = Engine(str(tiny_model_dir), name="tiny")
    engine.start(timeout=60)
    yield engine
    engine.close()
