"""What ``mesh up --split`` decides before any rank starts: the local plan, its refusals, and
the CLI's own checks of the flags."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from mesh.cli import app
from mesh.errors import NodeError, PlanError
from mesh.split.ranks import SplitWorkerProcess
from mesh.workers import SplitOptions, WorkerOptions
from worker.testing import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("split") / "tiny6", num_layers=6)


def test_the_local_plan_is_shown_and_splits_every_rank(model: Path, tmp_path: Path) -> None:
    options = WorkerOptions(home=tmp_path, split=SplitOptions(ranks=3, share_memory_bytes=10**9))
    plan = SplitWorkerProcess(str(model), options).make_plan()
    assert plan.layer_split() == [2, 2, 2]
    shown = plan.render()
    assert shown.startswith("tiny6: 6 layers, 4096-token context, pipeline over 3 ranks")
    assert "this node, rank 2" in shown


def test_too_little_shared_memory_is_one_sentence(model: Path, tmp_path: Path) -> None:
    options = WorkerOptions(home=tmp_path, split=SplitOptions(ranks=2, share_memory_bytes=10**6))
    with pytest.raises(PlanError) as caught:
        SplitWorkerProcess(str(model), options).make_plan()
    message = str(caught.value)
    assert message.startswith("tiny6 ") and "\n" not in message


def test_a_directory_that_is_no_model_cannot_be_split(tmp_path: Path) -> None:
    options = WorkerOptions(home=tmp_path, split=SplitOptions(ranks=2))
    with pytest.raises(NodeError, match=f"cannot split {tmp_path.name}"):
        SplitWorkerProcess(str(tmp_path), options)


@pytest.mark.parametrize(
    ("flags", "words"),
    [(["--split", "1"], "at least 2"), (["--split", "2", "--share-memory", "-1"], "size in GB")],
)
def test_bad_split_flags_are_refused_in_words(flags: list[str], words: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["up", "--home", str(tmp_path), "--model", "m", *flags])
    assert result.exit_code == 1
    assert words in result.output
