"""``--speculation`` travels from ``mesh up`` / ``mesh worker`` to the engine's config."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from mesh.cli import app
from mesh.node import NodeConfig
from mesh.workers import WorkerProcess
from worker.serve.main import build_parser
from worker.serve.split_rank import build_parser as rank_parser
from worker.serve.split_rank import leader_config


def test_the_node_passes_speculation_to_its_workers(tmp_path: Path) -> None:
    options = NodeConfig(home=tmp_path, models=("m",), speculation="off").worker_options()
    command = WorkerProcess("m", options)._command()
    assert command[command.index("--speculation") + 1] == "off"
    default = WorkerProcess("m", NodeConfig(home=tmp_path).worker_options())._command()
    assert default[default.index("--speculation") + 1] == "auto"


def test_the_worker_and_rank_0_read_it() -> None:
    args = ["--model", "m", "--speculation", "off"]
    assert build_parser().parse_args(args).speculation == "off"
    assert build_parser().parse_args(["--model", "m"]).speculation == "auto"
    assert rank_parser().parse_args(args).speculation == "off"
    assert leader_config([1, 1], 1 << 20, "off").speculation.mode == "off"


def test_an_unknown_mode_is_refused_in_words(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["worker", "--model", "m", "--home", str(tmp_path), "--speculation", "maybe"]
    )
    assert result.exit_code != 0
    assert "--speculation is auto or off" in result.output


def test_the_node_passes_its_draft_model_to_its_workers(tmp_path: Path) -> None:
    options = NodeConfig(home=tmp_path, models=("m",), draft_model="/d").worker_options()
    command = WorkerProcess("m", options)._command()
    assert command[command.index("--draft-model") + 1] == "/d"
    plain = NodeConfig(home=tmp_path, models=("m",)).worker_options()
    assert "--draft-model" not in WorkerProcess("m", plain)._command()
    assert build_parser().parse_args(["--model", "m", "--draft-model", "d"]).draft_model == "d"


def test_a_draft_model_of_another_vocabulary_is_refused_in_one_sentence(
    tmp_path: Path, tiny_model_dir: Path, tiny_tool_model_dir: Path
) -> None:
    """Before any worker starts (mesh up) or the weights load (mesh worker)."""
    import pytest

    from worker.engine.core import EngineError
    from worker.serve.main import run

    args = ["up", "--model", str(tiny_model_dir), "--draft-model", str(tiny_tool_model_dir)]
    result = CliRunner().invoke(app, [*args, "--home", str(tmp_path)])
    assert result.exit_code != 0
    said = " ".join(result.output.split())  # rich folds long lines
    assert "cannot draft for" in said and "the draft model's vocabulary has" in said
    with pytest.raises(EngineError, match=r"--draft-model .* refused: .*vocabulary"):
        run(str(tiny_model_dir), draft_model=str(tiny_tool_model_dir), fast_blas=False)


async def test_the_workers_speculation_counters_reach_the_status_picture(tmp_path: Path) -> None:
    """load() polls each worker's /health (for gossip); its speculation block is kept and the
    status picture (which feeds the gateway's /metrics) carries it."""
    from mesh.workers import WorkerOptions, WorkerSupervisor

    block = {"mode": "auto", "drafted": 10, "accepted": 7}

    class Client:
        model_name = "m"

        async def health(self) -> dict[str, object]:
            return {"queue_depth": 0, "speculation": block}

    supervisor = WorkerSupervisor(WorkerOptions(home=tmp_path), ["m"])
    process = WorkerProcess("m", supervisor.options)
    supervisor.processes.append(process)
    assert "speculation" not in supervisor.status()["m"]
    process.client = Client()  # type: ignore[assignment]
    await supervisor.load()
    assert supervisor.status()["m"]["speculation"] == block


async def test_the_workers_memory_and_cache_tiers_reach_the_status_picture(tmp_path: Path) -> None:
    """The budget (with the weights) and both prompt-cache tiers' blocks of the worker's last
    /health show under the node's ``workers.<model>`` (its /health): the lab's memory scenario
    reads them; a block the worker does not send (no budget: null) is left out."""
    from mesh.workers import WorkerOptions, WorkerSupervisor

    memory = {"limit_bytes": 16 << 20, "used_bytes": 1 << 20, "weight_bytes": 4096}
    tier = {"bytes": 1 << 20, "evictions": 3}
    disk = {"bytes": 3 << 20, "writes": 3, "loads": 1}

    class Client:
        model_name = "m"

        def __init__(self) -> None:
            self.body: dict[str, object] = {"memory": memory, "prompt_cache": tier, "cd": "x"}

        async def health(self) -> dict[str, object]:
            return self.body | {"queue_depth": 0, "prompt_cache_disk": disk}

    supervisor = WorkerSupervisor(WorkerOptions(home=tmp_path), ["m"])
    process = WorkerProcess("m", supervisor.options)
    supervisor.processes.append(process)
    process.client = client = Client()  # type: ignore[assignment]
    await supervisor.load()
    status = supervisor.status()["m"]
    assert status["memory"] == memory and status["prompt_cache"] == tier
    assert status["prompt_cache_disk"] == disk and "cd" not in status
    client.body = {"memory": None, "prompt_cache": tier}
    await supervisor.load()
    assert "memory" not in supervisor.status()["m"]
